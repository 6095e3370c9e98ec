"""A service's local replicas get their shard-store TLS files in the state folder at launch
(orchestrator.control.kvtls.replica_files); once the service is down, they are deleted."""

from __future__ import annotations

from orchestrator.common.kvtls import KEY_FILE
from orchestrator.control.auth import service_secret_path
from tests.fakes.standin import SPEC, StandInLauncher
from tests.helpers import running_daemon, wait_for


class IssuingLauncher(StandInLauncher):
    """The stand-in engine, with the TLS folder the real launcher issues to a local replica."""

    def request(self, spec, row, offer, runtime):
        self.tls_dir(spec, row, runtime)
        return super().request(spec, row, offer, runtime)


def test_a_deleted_services_replica_tls_folders_are_gone(state_home, monkeypatch):
    folder = service_secret_path("tidy", "kv-tls")
    with running_daemon(monkeypatch, launcher=IssuingLauncher()) as (_daemon, client):
        assert client.post("/v1/services", json={"yaml": SPEC.format(name="tidy")}).status_code == 200
        wait_for(lambda: any(r["state"] == "READY" for r in client.get("/v1/services/tidy").json()["replicas"]),
                 120, "a READY replica")
        replicas = list(folder.iterdir())
        assert len(replicas) == 1 and (replicas[0] / KEY_FILE).exists()
        assert client.delete("/v1/services/tidy").status_code == 200
        wait_for(lambda: client.get("/v1/services/tidy").status_code == 404, 120, "the service to be deleted")
    assert not folder.exists()
