"""Load and validate a service YAML into a `ServiceSpec`; every error is one `SpecError`.

A SkyServe `service:` section loads unchanged (SkyServe keys we do not act on, such as
`load_balancer` or `pool`, are kept); SkyPilot's top-level task keys (setup, run, envs, ...)
are kept in `ServiceSpec.task`. Ours: `service.placement_policy`, `engine:` and `kv:`.
Each error's single line names the field path and what was expected, e.g.
`service.replicas: expected an integer, got 'two'`. Clouds are checked by name only here;
whether a provider is registered for one is the control plane's question. The loader is safe
with hostile text: at most MAX_SPEC_BYTES, MAX_ALIASES aliases, MAX_DEPTH levels and MAX_NODES
nodes with every alias expanded (no "billion laughs"), only JSON's types (timestamps stay
strings, no binary, no infinities), each refusal one SpecError.

Called by the CLI (`spotctl up`: load_spec), the daemon's API (load_spec_text) and the store
(`spec_from_json`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from orchestrator.common.errors import UserError
from orchestrator.spec.model import (
    DEFAULT_LB_POLICY,
    DEFAULT_PLACEMENT_POLICY,
    LB_POLICIES,
    SPOT_PLACERS,
    TLS,
    Accelerator,
    EngineSpec,
    KV_FAILURE_DOMAINS,
    KVSpec,
    ReadinessProbe,
    ReplicaPolicy,
    Resources,
    ServiceSection,
    ServiceSpec,
    plain,
)

class SpecError(UserError):
    """A bad service spec; `path` is the dotted field path (e.g. 'service.replicas')."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


def spec_from_json(text: str) -> ServiceSpec:
    """A spec from what the store keeps (`ServiceSpec.to_json()`)."""
    return parse_spec(json.loads(text))


# ---- YAML loading ---------------------------------------------------------------------


MAX_SPEC_BYTES = 1 << 20  # a service spec is a few KiB; a MiB leaves room for long scripts
MAX_ALIASES = 64
MAX_DEPTH = 64
MAX_NODES = 100_000  # nodes of the document with every alias expanded
MAX_NUMBER = 1e9  # seconds, QPS, ...: beyond this a number is a mistake (and overflows timers)
MAX_REPLICAS = 1000


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one), alias bombs,
    deep nesting and values JSON cannot hold."""

    def __init__(self, stream):
        super().__init__(stream)
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent, index):
        line = self.peek_event().start_mark.line + 1
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise SpecError("", f"more than {MAX_ALIASES} YAML aliases (line {line}); write the values out")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise SpecError("", f"nested deeper than {MAX_DEPTH} levels (line {line})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            try:
                _expanded_size(node, {}, set())
            except RecursionError:
                raise SpecError("", "YAML aliases nested too deeply") from None
        return node

    def construct_mapping(self, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                line = key_node.start_mark.line + 1
                raise SpecError("", f"duplicate key {key!r} at line {line}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_finite_float(self, node):
        value = self.construct_yaml_float(node)
        if not math.isfinite(value):
            raise SpecError("", f"line {node.start_mark.line + 1}: {node.value!r} is not a finite number")
        return value

    def refuse_binary(self, node):
        raise SpecError("", f"line {node.start_mark.line + 1}: binary values (!!binary) are not supported")


_StrictLoader.add_constructor("tag:yaml.org,2002:float", _StrictLoader.construct_finite_float)
_StrictLoader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_yaml_str)  # as written
_StrictLoader.add_constructor("tag:yaml.org,2002:set", yaml.SafeLoader.construct_yaml_map)  # {a, b}: keys
_StrictLoader.add_constructor("tag:yaml.org,2002:binary", _StrictLoader.refuse_binary)


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Nodes under `node` with aliases expanded; raises SpecError past MAX_NODES or for an
    alias inside what it names."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise SpecError("", f"line {node.start_mark.line + 1}: a YAML alias refers to a node that contains it")
    open_nodes.add(key)
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    else:
        children = []
    total = 1 + sum(_expanded_size(child, sizes, open_nodes) for child in children)
    if total > MAX_NODES:
        raise SpecError("", f"more than {MAX_NODES} values once its YAML aliases are expanded")
    open_nodes.discard(key)
    sizes[key] = total
    return total


def _looks_like_path(text: str) -> bool:
    return "\n" not in text and (text.endswith((".yaml", ".yml", ".json")) or ":" not in text)


def load_spec(path_or_text: str | Path) -> ServiceSpec:
    """Parse a YAML file (a Path, or a one-line str ending in .yaml/.yml or without a colon)
    or YAML text. The name defaults to the file's stem. Raises SpecError."""
    if isinstance(path_or_text, Path) or _looks_like_path(str(path_or_text)):
        path = Path(path_or_text).expanduser()
        try:
            if path.stat().st_size > MAX_SPEC_BYTES:
                raise SpecError("", f"{path}: larger than {MAX_SPEC_BYTES} bytes; a service spec is a few KiB")
            text = path.read_text()
        except FileNotFoundError:
            raise SpecError("", f"file not found: {path}") from None
        except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
            raise SpecError("", f"cannot read {path}: {type(err).__name__}") from None
        return load_spec_text(text, source=str(path), name=path.stem)
    return load_spec_text(str(path_or_text))


def load_spec_text(text: str, source: str = "spec", name: str | None = None) -> ServiceSpec:
    """Parse YAML text (never a path: what the daemon's API receives). Raises SpecError."""
    if len(text) > MAX_SPEC_BYTES or len(text.encode("utf-8", "replace")) > MAX_SPEC_BYTES:
        raise SpecError("", f"{source}: larger than {MAX_SPEC_BYTES} bytes; a service spec is a few KiB")
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except SpecError as err:
        raise SpecError("", f"{source}: {err}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError("", f"{source}: invalid YAML{where}: {err.problem or err.context}") from None
    except yaml.YAMLError as err:
        raise SpecError("", f"{source}: invalid YAML: {err}") from None
    except (ValueError, RecursionError) as err:  # e.g. an integer of more digits than Python converts
        why = "a number with too many digits" if "digits" in str(err) else type(err).__name__
        raise SpecError("", f"{source}: invalid YAML: {why}") from None
    if data is None:
        raise SpecError("", f"{source}: empty; expected a mapping with at least engine.model")
    return parse_spec(data, name=name)


# ---- validation -----------------------------------------------------------------------


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple, set)):
        return "a list"
    return repr(value)


class _Fields:
    """One mapping under validation: typed getters that name the field path in every error.

    Unknown keys are refused at construction, with a did-you-mean from the known ones.
    """

    def __init__(self, data: Any, path: str, known: Iterable[str]):
        if not isinstance(data, Mapping):
            raise SpecError(path or "(top level)", f"expected a mapping, got {_show(data)}")
        known = list(known)
        for key in data:
            if not isinstance(key, str) or key not in known:
                close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else f"; expected one of {', '.join(known)}"
                raise SpecError(self._join(path, str(key)), f"unknown key{hint}")
        self.data, self.path = data, path

    @staticmethod
    def _join(path: str, key: str) -> str:
        return f"{path}.{key}" if path else key

    def at(self, key: str) -> str:
        return self._join(self.path, key)

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def error(self, key: str, message: str) -> SpecError:
        return SpecError(self.at(key), message)

    def integer(
        self, key: str, default: Any = None, *, minimum: int | None = None, maximum: int | None = None
    ):
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise self.error(key, f"expected an integer, got {_show(value)}")
        _check_range(self.at(key), value, minimum, maximum)
        return value

    def number(self, key: str, default: Any = None, *, minimum: float | None = None, positive: bool = False):
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"expected a number, got {_show(value)}")
        if positive and value <= 0:
            raise self.error(key, f"expected a number > 0, got {value}")
        if abs(value) > MAX_NUMBER:
            raise self.error(key, f"expected a number of at most {MAX_NUMBER:g}, got {value:g}")
        _check_range(self.at(key), value, minimum, None)
        return float(value)

    def boolean(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {_show(value)}")
        return value

    def string(self, key: str, default: Any = None, *, choices: Iterable[str] | None = None) -> Any:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise self.error(key, f"expected a string, got {_show(value)}")
        value = str(value).strip()
        if not value:
            raise self.error(key, "expected a non-empty string")
        if choices is not None:
            choices = list(choices)
            if value.lower() not in choices:
                raise self.error(key, f"expected one of {', '.join(choices)}, got {value!r}")
            value = value.lower()
        return value

    def mapping(self, key: str, known: Iterable[str]) -> _Fields:
        value = self.data.get(key)
        return _Fields({} if value is None else value, self.at(key), known)


def _check_range(path: str, value: float, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and value < minimum:
        raise SpecError(path, f"expected a value >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SpecError(path, f"expected a value <= {maximum}, got {value}")


# SkyPilot's task keys besides name/service/resources: accepted and kept, unused locally.
TASK_KEYS = (
    "setup", "run", "envs", "secrets", "workdir", "num_nodes", "file_mounts", "volumes",
    "config", "inputs", "outputs", "event_callback", "file_mounts_mapping", "volume_mounts",
)  # fmt: skip
TOP_KEYS = ("name", "service", "resources", "engine", "kv", *TASK_KEYS)
SERVICE_KEYS = (
    "readiness_probe", "replicas", "replica_policy", "load_balancing_policy", "ports", "tls",
    "placement_policy", "load_balancer", "pool", "workers",
)  # fmt: skip
SERVICE_EXTRA_KEYS = ("load_balancer", "pool", "workers")
PROBE_KEYS = (
    "path", "initial_delay_seconds", "timeout_seconds", "post_data", "headers",
    "endpoint_probe_interval_seconds", "consecutive_failure_threshold_timeout",
)  # fmt: skip
POLICY_KEYS = tuple(f.name for f in dataclasses.fields(ReplicaPolicy))
RESOURCE_KEYS = ("cloud", "region", "zone", "infra", "instance_type", "accelerators", "use_spot", "ports")
# SkyPilot's other resource keys: kept for templates that launch through SkyPilot.
RESOURCE_EXTRA_KEYS = (
    "cpus", "memory", "disk_size", "disk_tier", "image_id", "labels", "accelerator_args",
    "autostop", "network_tier", "job_recovery", "priority", "volumes", "local_disk",
    "max_hourly_cost", "ephemeral_storage", "priority_class",
)  # fmt: skip
ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineSpec))
KV_KEYS = tuple(f.name for f in dataclasses.fields(KVSpec))
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_CLOUD_RE = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt])?(i)?b?\s*$", re.IGNORECASE)


def parse_spec(data: Any, name: str | None = None) -> ServiceSpec:
    """Validate a loaded mapping. `name` (e.g. the file's stem) is used when it has none."""
    top = _Fields(data, "", TOP_KEYS)
    resources = _parse_resources(top.mapping("resources", (*RESOURCE_KEYS, "any_of", "ordered", *RESOURCE_EXTRA_KEYS)))
    return ServiceSpec(
        name=_parse_name(top, name),
        engine=_parse_engine(top),
        service=_parse_service(top.mapping("service", SERVICE_KEYS)),
        resources=resources,
        kv=_parse_kv(top.mapping("kv", KV_KEYS), resources),
        task={k: plain(top.data[k]) for k in TASK_KEYS if k in top.data},
    )


def _parse_name(top: _Fields, fallback: str | None) -> str:
    explicit = top.string("name")
    if explicit is None:
        if fallback is None:
            raise top.error("name", "required (or load the spec from a file, whose name is used)")
        # A file name is a hint, not something the user typed as a name: make it one.
        explicit = re.sub(r"[^a-z0-9-]+", "-", fallback.lower()).strip("-") or "service"
        if not explicit[0].isalpha():
            explicit = f"svc-{explicit}"
        return explicit[:63]
    if not _NAME_RE.match(explicit):
        raise top.error(
            "name", f"expected lowercase letters, digits and '-', starting with a letter, got {explicit!r}"
        )
    return explicit


def _parse_probe(svc: _Fields) -> ReadinessProbe:
    raw = svc.data.get("readiness_probe")
    if raw is None:
        return ReadinessProbe()
    if isinstance(raw, str):
        probe = ReadinessProbe(path=raw.strip())
        path_key = "readiness_probe"
    else:
        f = svc.mapping("readiness_probe", PROBE_KEYS)
        if not f.has("path"):
            raise f.error("path", "required")
        headers = f.raw("headers", {})
        if not isinstance(headers, Mapping) or not all(isinstance(v, str) for v in headers.values()):
            raise f.error("headers", "expected a mapping of header names to strings")
        post_data = f.raw("post_data")
        if isinstance(post_data, str):
            try:
                post_data = json.loads(post_data)
            except json.JSONDecodeError:
                raise f.error("post_data", "expected a mapping or a JSON string") from None
        elif post_data is not None and not isinstance(post_data, Mapping):
            raise f.error("post_data", f"expected a mapping or a JSON string, got {_show(post_data)}")
        probe = ReadinessProbe(
            path=f.string("path"),
            initial_delay_seconds=f.number("initial_delay_seconds", 1200.0, minimum=0),
            timeout_seconds=f.number("timeout_seconds", 15.0, positive=True),
            post_data=plain(post_data) if post_data is not None else None,
            headers=dict(headers),
            endpoint_probe_interval_seconds=f.number("endpoint_probe_interval_seconds", positive=True),
            consecutive_failure_threshold_timeout=f.number(
                "consecutive_failure_threshold_timeout", minimum=0
            ),
        )
        path_key = "readiness_probe.path"
    if not probe.path.startswith("/"):
        raise SpecError(svc.at(path_key), f"must start with '/', got {probe.path!r}")
    return probe


def _parse_replica_policy(svc: _Fields) -> ReplicaPolicy:
    if svc.has("replicas") and svc.has("replica_policy"):
        raise svc.error("replicas", "give either replicas or replica_policy, not both")
    if not svc.has("replica_policy"):
        n = svc.integer("replicas", 1, minimum=0, maximum=MAX_REPLICAS)
        return ReplicaPolicy(min_replicas=n, max_replicas=n)
    f = svc.mapping("replica_policy", POLICY_KEYS)
    if not f.has("min_replicas"):
        raise f.error("min_replicas", "required")
    lo = f.integer("min_replicas", minimum=0, maximum=MAX_REPLICAS)
    hi = f.integer("max_replicas", minimum=0, maximum=MAX_REPLICAS)
    if hi is not None and lo > hi:
        raise f.error("min_replicas", f"({lo}) > max_replicas ({hi})")
    qps = _parse_target_qps(f)
    # SkyServe's rules: autoscaling needs a QPS target, and a QPS target needs a ceiling.
    if qps is not None and hi is None:
        raise f.error("max_replicas", "required when target_qps_per_replica is set")
    if qps is None and hi is not None and hi != lo:
        raise f.error("target_qps_per_replica", f"required when max_replicas ({hi}) != min_replicas ({lo})")
    return ReplicaPolicy(
        min_replicas=lo,
        max_replicas=hi,
        target_qps_per_replica=qps,
        num_overprovision=f.integer("num_overprovision", 0, minimum=0, maximum=MAX_REPLICAS),
        base_ondemand_fallback_replicas=f.integer("base_ondemand_fallback_replicas", 0, minimum=0,
                                                  maximum=MAX_REPLICAS),
        dynamic_ondemand_fallback=f.boolean("dynamic_ondemand_fallback", False),
        spot_placer=f.string("spot_placer", choices=SPOT_PLACERS),
        upscale_delay_seconds=f.number("upscale_delay_seconds", 300.0, minimum=0),
        downscale_delay_seconds=f.number("downscale_delay_seconds", 1200.0, minimum=0),
    )


def _parse_target_qps(f: _Fields) -> float | dict[str, float] | None:
    raw = f.data.get("target_qps_per_replica")
    if not isinstance(raw, Mapping):
        return f.number("target_qps_per_replica", positive=True)
    out = {}
    for acc, qps in raw.items():  # SkyServe: per-accelerator targets, e.g. {H100: 4, A100:1: 2}
        path = f"{f.at('target_qps_per_replica')}.{acc}"
        if isinstance(qps, bool) or not isinstance(qps, (int, float)) or not 0 < qps <= MAX_NUMBER:
            raise SpecError(path, f"expected a number > 0, got {_show(qps)}")
        out[str(acc)] = float(qps)
    return out


def _parse_service(svc: _Fields) -> ServiceSection:
    tls = None
    if svc.has("tls"):
        t = svc.mapping("tls", ("keyfile", "certfile"))
        for key in ("keyfile", "certfile"):
            if not t.has(key):
                raise t.error(key, "required")
        tls = TLS(keyfile=t.string("keyfile"), certfile=t.string("certfile"))
    policy_name = svc.string("placement_policy", DEFAULT_PLACEMENT_POLICY)
    if not re.match(r"^[A-Za-z0-9_.-]+$", policy_name):
        raise svc.error("placement_policy", f"expected a policy name, got {policy_name!r}")
    for key in SERVICE_EXTRA_KEYS:
        if key in ("load_balancer", "pool") and svc.has(key) and not isinstance(svc.data[key], Mapping):
            raise svc.error(key, f"expected a mapping, got {_show(svc.data[key])}")
    replicas = svc.integer("replicas", minimum=0, maximum=MAX_REPLICAS) if not svc.has("replica_policy") else None
    return ServiceSection(
        readiness_probe=_parse_probe(svc),
        replica_policy=_parse_replica_policy(svc),
        replicas=replicas,
        load_balancing_policy=svc.string("load_balancing_policy", DEFAULT_LB_POLICY, choices=LB_POLICIES),
        ports=svc.integer("ports", minimum=1, maximum=65535),
        tls=tls,
        placement_policy=policy_name,
        extra={k: plain(svc.data[k]) for k in SERVICE_EXTRA_KEYS if svc.has(k)},
    )


def _parse_accelerators(f: _Fields) -> tuple[Accelerator, ...]:
    raw = f.data.get("accelerators")
    path = f.at("accelerators")
    if raw is None:
        return ()
    if isinstance(raw, str):
        items: list[tuple[str, Any]] = [_split_accelerator(raw, path)]
    elif isinstance(raw, Mapping):  # {A100: 1} or the set form {A100, V100} (values None)
        items = [(str(k), 1 if v is None else v) for k, v in raw.items()]
    elif isinstance(raw, (list, tuple, set)):
        items = []
        for i, item in enumerate(raw):
            if isinstance(item, str):
                items.append(_split_accelerator(item, f"{path}[{i}]"))
            elif isinstance(item, Mapping) and len(item) == 1:
                ((k, v),) = item.items()
                items.append((str(k), 1 if v is None else v))
            else:
                raise SpecError(f"{path}[{i}]", f"expected 'NAME' or 'NAME:COUNT', got {_show(item)}")
    else:
        raise SpecError(path, f"expected 'NAME:COUNT', a mapping or a list, got {_show(raw)}")
    out = []
    for name, count in items:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise SpecError(path, f"{name}: expected a whole accelerator count >= 1, got {_show(count)}")
        if not name.strip():
            raise SpecError(path, "expected an accelerator name")
        out.append(Accelerator(name.strip(), count))
    return tuple(out)


def _split_accelerator(text: str, path: str) -> tuple[str, Any]:
    name, _, count = text.strip().partition(":")
    if not count:
        return name, 1
    try:
        return name, int(count)
    except ValueError:
        raise SpecError(path, f"expected 'NAME' or 'NAME:COUNT', got {text!r}") from None


def _parse_ports(f: _Fields) -> tuple[str, ...]:
    raw = f.data.get("ports")
    if raw is None:
        return ()
    items = raw if isinstance(raw, (list, tuple)) else [raw]
    out = []
    for item in items:
        text = str(item).strip()
        if isinstance(item, bool) or not re.match(r"^\d+(-\d+)?$", text):
            raise f.error("ports", f"expected a port, a range 'A-B' or a list of them, got {_show(item)}")
        out.append(text)
    return tuple(out)


def _parse_resources(f: _Fields, *, nested: bool = False) -> Resources:
    cloud, region, zone = f.string("cloud"), f.string("region"), f.string("zone")
    if f.has("infra"):  # SkyPilot >= 0.10: infra: aws/us-east-1/us-east-1a ('*' = any)
        if cloud or region or zone:
            raise f.error("infra", "give either infra or cloud/region/zone, not both")
        parts = [None if p in ("*", "") else p for p in f.string("infra").split("/", 2)]
        cloud, region, zone = (parts + [None, None])[:3]
    if cloud is not None:
        cloud = cloud.lower()
        if not _CLOUD_RE.match(cloud):  # which clouds exist is the provider registry's to say
            raise f.error("cloud", f"expected a cloud name (letters, digits, '-'), got {cloud!r}")
    alternatives: tuple[Resources, ...] = ()
    for key in ("any_of", "ordered"):
        if not f.has(key):
            continue
        if nested:
            raise f.error(key, "cannot be nested")
        if alternatives:
            raise f.error(key, "give either any_of or ordered, not both")
        raw = f.data[key]
        if not isinstance(raw, (list, tuple)) or not raw:
            raise f.error(key, f"expected a non-empty list of resource mappings, got {_show(raw)}")
        alternatives = tuple(
            _parse_resources(
                _Fields(item, f"{f.at(key)}[{i}]", (*RESOURCE_KEYS, *RESOURCE_EXTRA_KEYS)), nested=True
            )
            for i, item in enumerate(raw)
        )
    return Resources(
        cloud=cloud,
        region=region,
        zone=zone,
        instance_type=f.string("instance_type"),
        accelerators=_parse_accelerators(f),
        use_spot=f.boolean("use_spot"),
        ports=_parse_ports(f),
        any_of=alternatives,
        ordered=f.has("ordered"),
        extra={k: plain(f.data[k]) for k in RESOURCE_EXTRA_KEYS if f.has(k)},
    )


def _parse_engine(top: _Fields) -> EngineSpec:
    if not top.has("engine"):
        raise top.error(
            "engine", "required (at least engine.model: a HF model id, a local directory or 'tiny')"
        )
    f = top.mapping("engine", ENGINE_KEYS)
    if not f.has("model"):
        raise f.error("model", "required (a HF model id, a local directory or 'tiny')")
    raw_args = f.raw("args", [])
    if isinstance(raw_args, str):
        args = tuple(shlex.split(raw_args))
    elif isinstance(raw_args, (list, tuple)) and all(
        isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in raw_args
    ):
        args = tuple(str(a) for a in raw_args)
    else:
        raise f.error("args", f"expected a list of vLLM command-line arguments, got {_show(raw_args)}")
    return EngineSpec(
        model=f.string("model"),
        args=args,
        max_model_len=f.integer("max_model_len", minimum=16),
        block_size=f.integer("block_size", minimum=1),
        dtype=f.string("dtype", choices=DTYPES),
    )


def _parse_size(f: _Fields, key: str, default: int) -> int:
    """Bytes as an integer or a size string: '512MB' (powers of 1000), '2GiB' (of 1024)."""
    raw = f.data.get(key)
    if raw is None:
        return default
    match = _SIZE_RE.match(raw) if isinstance(raw, str) else None
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif match:
        number, unit, binary = match.group(1), (match.group(2) or "").lower(), match.group(3)
        power = " kmgt".index(unit) if unit else 0
        value = int(float(number) * (1024 if binary else 1000) ** power)
    else:
        raise f.error(key, f"expected bytes or a size like '2GiB' or '512MB', got {_show(raw)}")
    if value < 1:
        raise f.error(key, f"expected a size >= 1 byte, got {_show(raw)}")
    return value


def _parse_kv(f: _Fields, resources: Resources) -> KVSpec:
    kv = KVSpec(
        enabled=f.boolean("enabled", True),
        k=f.integer("k", 4, minimum=1, maximum=32),
        m=f.integer("m", 2, minimum=1, maximum=32),  # the codec needs one parity shard
        failure_domain=f.string("failure_domain", "zone", choices=KV_FAILURE_DOMAINS),
        store_max_bytes=_parse_size(f, "store_max_bytes", 1 << 30),
        ttl_seconds=f.number("ttl_seconds", 3600.0, positive=True),
    )
    if kv.enabled and f.has("failure_domain"):  # asked for: the default only warns at runtime
        _check_survivable(f, kv, resources)
    return kv


def _check_survivable(f: _Fields, kv: KVSpec, resources: Resources) -> None:
    """SpecError when `resources` pin the replicas to fewer failure domains than k+m shards
    with at most m per domain need (the replicas may go anywhere else: checked at runtime)."""
    depth = KV_FAILURE_DOMAINS[::-1].index(kv.failure_domain) + 1  # cloud: 1, region: 2, zone: 3
    units = set()
    for alt in resources.any_of or (resources,):
        unit = tuple(getattr(alt, name) or getattr(resources, name) for name in ("cloud", "region", "zone")[:depth])
        if None in unit:
            return  # this alternative may land in any such domain
        units.add(unit)
    need = -(-(kv.k + kv.m) // kv.m)
    if len(units) < need:
        listed = ", ".join("/".join(u) for u in sorted(units))
        raise f.error("failure_domain", f"{kv.failure_domain!r} needs replicas in at least {need} "
                      f"{kv.failure_domain}s for k={kv.k}, m={kv.m}, but resources allow only {listed}")
