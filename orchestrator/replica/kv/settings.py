"""The connector's `kv_connector_extra_config`, validated into one ConnectorSettings value.

    {"stores": [{"node_id", "endpoint", "cloud", "region", "zone"}, ...], "membership_url": URL,
     "node_id", "self_endpoint", "cloud", "region", "zone" (this replica's own store),
     "membership_poll_s": 5.0, "secret" | "secret_file", "k": 4, "m": 2, "timeout_s": 2.0,
     "control_port", "control_host": "127.0.0.1", "model_id", "max_pending_mb": 256,
     "push_batch_blocks": 64, "repair_mb_per_s": 200, "failure_domain": "zone", "tls_ca_file": PATH,
     "egress": {cloud: {"out_of_cloud": usd_per_gb, "inter_region": usd_per_gb}}}

The connector parses it when vLLM constructs it; every field is explained in docs/kv-cache.md.
`transfer_config` wraps an extra config into the value of vLLM's --kv-transfer-config (scripts and
tests; the daemon's launcher, which cannot import this package, builds the same JSON itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.common.errors import UserError
from orchestrator.replica.kv.egress import EgressPrices
from orchestrator.replica.kv.placement import FAILURE_DOMAINS, StoreNode, parse_nodes

CONNECTOR_NAME = "SpotKVConnector"
CONNECTOR_MODULE = "orchestrator.replica.kv.connector"

_SELF_FIELDS = ("node_id", "self_endpoint", "cloud", "region", "zone")
_FIELDS = {"stores", "membership_url", "membership_poll_s", *_SELF_FIELDS, "secret", "secret_file", "k", "m",
           "timeout_s", "control_port", "control_host", "model_id", "max_pending_mb", "push_batch_blocks",
           "repair_mb_per_s", "failure_domain", "tls_ca_file", "egress"}


@dataclass(frozen=True)
class ConnectorSettings:
    stores: tuple[StoreNode, ...]       # static members (may be empty)
    secret: str
    self_store: StoreNode | None = None
    membership_url: str | None = None
    membership_poll_s: float = 5.0
    k: int = 4
    m: int = 2
    timeout_s: float = 2.0
    control_port: int | None = None
    control_host: str = "127.0.0.1"
    model_id: str | None = None
    max_pending_bytes: int = 256 << 20
    push_batch_blocks: int = 64
    repair_bytes_per_s: float | None = 200e6  # None: no limit
    failure_domain: str = "zone"  # zone | region | cloud: what losing leaves k shards of a group
    tls_ca_file: str | None = None  # the service CA: stores in other clouds are spoken to over TLS
    egress: EgressPrices = EgressPrices()


def transfer_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The value of vLLM's --kv-transfer-config that enables the connector with this extra config."""
    return {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_both", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": dict(extra)}


def _number(extra: Mapping[str, Any], name: str, default, kind: type, low: float):
    value = extra.get(name, default)
    if value is None:
        return None
    if isinstance(value, str):  # launchers substitute ports into JSON templates as strings
        try:
            value = kind(value)
        except ValueError:
            raise UserError(f"kv_connector_extra_config.{name}: expected {kind.__name__}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise UserError(f"kv_connector_extra_config.{name}: expected {kind.__name__}, got {value!r}")
    if value < low:
        raise UserError(f"kv_connector_extra_config.{name}: must be >= {low}, got {value!r}")
    return kind(value)


def _secret(extra: Mapping[str, Any]) -> str:
    if "secret" in extra and "secret_file" in extra:
        raise UserError("kv_connector_extra_config: give either 'secret' or 'secret_file', not both")
    if "secret_file" in extra:
        path = Path(str(extra["secret_file"]))
        try:
            secret = path.read_text().strip()
        except OSError as err:
            raise UserError(f"kv_connector_extra_config.secret_file: cannot read {path}: {err.strerror}") from None
    else:
        secret = extra.get("secret")
        if not isinstance(secret, str):
            raise UserError("kv_connector_extra_config: 'secret' or 'secret_file' is required")
        secret = secret.strip()
    if not secret:
        raise UserError("kv_connector_extra_config: the shard-store secret is empty")
    return secret


def _self_store(extra: Mapping[str, Any]) -> StoreNode | None:
    given = [name for name in _SELF_FIELDS if name in extra]
    if not given:
        return None
    if len(given) < len(_SELF_FIELDS):
        missing = next(name for name in _SELF_FIELDS if name not in extra)
        raise UserError(f"kv_connector_extra_config.{missing}: required with {given[0]!r} (this replica's store)")
    fields = {name: extra[name] for name in _SELF_FIELDS}
    fields["endpoint"] = fields.pop("self_endpoint")
    return parse_nodes([fields])[0]


def _repair_limit(extra: Mapping[str, Any]) -> float | None:
    """Bytes per second, or None for no limit (0 or null)."""
    mb_per_s = _number(extra, "repair_mb_per_s", 200, float, 0)
    return mb_per_s * 1e6 if mb_per_s else None


def parse_settings(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """The settings in `extra`. Raises UserError naming the first bad field (unknown, mistyped,
    out of range, an unreadable secret_file, no shard stores at all), so a replica fails at
    start with one line."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _FIELDS)
    if unknown:
        raise UserError(f"kv_connector_extra_config: unknown field {unknown[0]!r} "
                        f"(expected some of {', '.join(sorted(_FIELDS))})")
    stores = extra.get("stores", [])
    if not isinstance(stores, list):
        raise UserError("kv_connector_extra_config.stores: expected a list of shard stores")
    self_store = _self_store(extra)
    url = extra.get("membership_url")
    if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
        raise UserError("kv_connector_extra_config.membership_url: expected an http(s) URL")
    if not stores and self_store is None and url is None:
        raise UserError("kv_connector_extra_config: no shard stores: give 'stores', 'membership_url' "
                        "or this replica's own store ('node_id', 'self_endpoint', 'cloud', 'region', 'zone')")
    model_id = extra.get("model_id")
    if model_id is not None and (not isinstance(model_id, str) or not model_id.strip()):
        raise UserError("kv_connector_extra_config.model_id: expected a non-empty string")
    host = extra.get("control_host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise UserError("kv_connector_extra_config.control_host: expected a host name or address")
    domain = extra.get("failure_domain", "zone")
    if domain not in FAILURE_DOMAINS:
        raise UserError(f"kv_connector_extra_config.failure_domain: expected one of {', '.join(FAILURE_DOMAINS)}, "
                        f"got {domain!r}")
    ca_file = extra.get("tls_ca_file")
    if ca_file is not None and (not isinstance(ca_file, str) or not Path(ca_file).is_file()):
        raise UserError(f"kv_connector_extra_config.tls_ca_file: not a readable file: {ca_file!r}")
    settings = ConnectorSettings(
        stores=tuple(parse_nodes(stores)),
        secret=_secret(extra),
        self_store=self_store,
        membership_url=url,
        membership_poll_s=_number(extra, "membership_poll_s", 5.0, float, 0.1),
        k=_number(extra, "k", 4, int, 1),
        m=_number(extra, "m", 2, int, 0),
        timeout_s=_number(extra, "timeout_s", 2.0, float, 0.001),
        control_port=_number(extra, "control_port", None, int, 0),
        control_host=host,
        model_id=model_id,
        max_pending_bytes=int(_number(extra, "max_pending_mb", 256, float, 1) * (1 << 20)),
        push_batch_blocks=_number(extra, "push_batch_blocks", 64, int, 1),
        repair_bytes_per_s=_repair_limit(extra),
        failure_domain=domain,
        tls_ca_file=ca_file,
        egress=EgressPrices.parse(extra.get("egress")),
    )
    if settings.control_port is not None and settings.control_port > 65535:
        raise UserError(f"kv_connector_extra_config.control_port: not a port: {settings.control_port}")
    return settings
