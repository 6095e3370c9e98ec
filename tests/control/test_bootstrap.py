"""A VM's secrets by one-time token (never in its user-data): redeemed once, only for the
instance the launch recorded, with its shard store's TLS files; the daemon's own wheel for a
booting VM; the boot script; a local replica's TLS files."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from orchestrator.common.kvtls import CA_FILE, CERT_FILE, KEY_FILE, store_server_name

from orchestrator.control.bootstrap import BootstrapError, BootstrapTokens
from orchestrator.control.store import Store
from orchestrator.control.wheel import version
from orchestrator.spec.parse import load_spec_text
from tests.fakes.launching import launch_request
from tests.helpers import running_daemon
from providers.aws import AWSProvider
from providers.base import Location, Market
from providers.egress import egress_table
from providers.local import LocalProvider

SPEC = "name: boot\nengine: {model: m}\nenvs: {HF_TOKEN: hf-secret, MODE: fast}\n"


def _replica(store: Store, instance_id: str | None):
    row = store.add_replica("boot", cloud="aws", region="us-east-1", zone="us-east-1a", market="spot")
    if instance_id:
        row = store.update_replica(row.replica_id, row.version, instance_id=instance_id)
    return row


def test_a_token_is_redeemed_once_by_its_own_instance(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    store.create_or_update_service("boot", "{}")
    tokens = BootstrapTokens(store)
    early, late = _replica(store, None), _replica(store, "i-1")
    with pytest.raises(BootstrapError) as not_yet:
        tokens.redeem(tokens.issue("boot", early.replica_id), "i-0")
    assert not_yet.value.status == 409  # the launch is not recorded yet: the VM retries
    token = tokens.issue("boot", late.replica_id)
    with pytest.raises(BootstrapError) as other:
        tokens.redeem(token, "i-2")
    assert other.value.status == 403
    assert tokens.redeem(token, "i-1").replica_id == late.replica_id
    with pytest.raises(BootstrapError, match="already used"):
        tokens.redeem(token, "i-1")
    with pytest.raises(BootstrapError, match="unknown"):
        tokens.redeem("made-up", "i-1")


def test_the_api_gives_the_secret_and_envs_once_and_the_wheel_before(state_home, monkeypatch):
    with running_daemon(monkeypatch, probe_interval_s=None) as (daemon, client):
        # The service in the store, but no controller: none of its own launches races this
        # hand-made replica (a reconcile would pick the PENDING row up and launch it).
        daemon.store.create_or_update_service("boot", load_spec_text(SPEC).to_json())
        row = _replica(daemon.store, "i-42")
        token = daemon.bootstrap.issue("boot", row.replica_id)
        boot = {"Authorization": f"Bootstrap {token}"}
        anonymous = httpx.Client(base_url=daemon.url, timeout=300)
        wheel = anonymous.get("/v1/bootstrap/wheel", headers=boot)
        assert wheel.status_code == 200
        path = state_home / "got.whl"
        path.write_bytes(wheel.content)
        names = zipfile.ZipFile(path).namelist()
        assert "orchestrator/replica/main.py" in names and any(n.endswith(".dist-info/METADATA") for n in names)
        assert f"Version: {version()}" in zipfile.ZipFile(path).read(
            next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        assert anonymous.get("/v1/bootstrap/wheel").status_code == 401
        stale = anonymous.post("/v1/bootstrap/redeem", json={"instance_id": "i-42", "version": "0.0.1"}, headers=boot)
        assert stale.status_code == 409 and "is not the daemon's" in stale.json()["detail"]
        got = anonymous.post("/v1/bootstrap/redeem", json={"instance_id": "i-42", "version": version()}, headers=boot)
        assert got.status_code == 200, got.text
        body = got.json()
        token = body["env"].pop("SPOT_ORCHESTRATOR_REPLICA_TOKEN")  # its own identity, for notices
        assert token.startswith(f"spr1.boot.{row.replica_id}.")
        assert body["env"] == {"HF_TOKEN": "hf-secret", "MODE": "fast"} and len(body["kv_secret"]) >= 32
        _assert_store_credentials(body["kv_tls"], "boot", row.replica_id)
        again = anonymous.post("/v1/bootstrap/redeem", json={"instance_id": "i-42", "version": version()},
                               headers=boot)
        assert again.status_code == 401
        assert anonymous.get("/v1/bootstrap/wheel", headers=boot).status_code == 401  # redeemed: no more


def _assert_store_credentials(creds: dict, service: str, replica_id: str) -> None:
    """A key and certificate for the replica's store name, signed by the service's CA."""
    ca = x509.load_pem_x509_certificate(creds["ca"].encode())
    cert = x509.load_pem_x509_certificate(creds["cert"].encode())
    key = serialization.load_pem_private_key(creds["key"].encode(), password=None)
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == [store_server_name(replica_id)]
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()
    assert service in ca.subject.rfc4514_string()


def test_a_local_replica_gets_its_store_files_and_the_kv_placement_settings(state_home):
    request = launch_request(LocalProvider(), "r7", Location("local", "local-1", "local-1a"), Market.SPOT,
                             kv=True)
    engine = request.command[request.command.index("--"):]
    extra = json.loads(engine[engine.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["failure_domain"] == "zone" and extra["egress"] == egress_table()
    folder = Path(extra["tls_ca_file"]).parent
    assert request.command[request.command.index("--tls-dir") + 1] == str(folder)
    assert (folder / KEY_FILE).stat().st_mode & 0o077 == 0
    creds = {"ca": (folder / CA_FILE).read_text(), "cert": (folder / CERT_FILE).read_text(),
             "key": (folder / KEY_FILE).read_text()}
    _assert_store_credentials(creds, "chat", "r7")


def test_the_boot_script_names_the_token_and_never_a_secret():
    request = launch_request(AWSProvider(["us-east-1"]), "r1", Location("aws", "us-east-1", "us-east-1a"),
                             Market.SPOT, kv=True)
    script = request.boot_script
    assert "BOOT_TOKEN=test-bootstrap-token" in script and "--bootstrap-token \"$BOOT_TOKEN\"" in script
    assert "uv pip install" in script
    assert "[replica,gpu]" in script and "SPOT_ORCHESTRATOR_KV_SECRET" not in script
    assert "PRIVATE KEY" not in script and "CERTIFICATE" not in script  # TLS files come at redemption
    assert "--tls-dir '{home}/kv-tls'" in script and '"tls_ca_file": "{home}/kv-tls/kv-ca.crt"' in script
    assert "--host '{host}'" in script and "--port 8000" in script and "secret_file" in script
    assert request.ports == (8000, 8471, 8472) and request.boot_script.startswith("#!/bin/bash")
