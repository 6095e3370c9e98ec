"""Shared test fixtures: isolated state directories, free ports, the replica runtime check, moto."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import free_port, moto_session, stop_autostarted_daemon

REPO = Path(__file__).resolve().parent.parent
REPLICA_PYTHON = REPO / ".venv-replica" / "bin" / "python"


def _replica_has_vllm() -> str | None:
    """None when the replica runtime can run vLLM, else why not (the skip reason)."""
    if not REPLICA_PYTHON.exists():
        return f"replica runtime missing ({REPLICA_PYTHON}); run `make install`"
    probe = subprocess.run([str(REPLICA_PYTHON), "-c", "import vllm, orchestrator"], capture_output=True, timeout=120)
    if probe.returncode != 0:
        return f"vllm does not import in {REPLICA_PYTHON}: {probe.stderr.decode()[-200:]}"
    return None


REPLICA_LOG_LINES = 80


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that ran replicas shows the end of each replica's log (vLLM, its engine
    and its agent write there) in its report: in CI that is all there is to go on."""
    report = yield
    home = getattr(item, "funcargs", {}).get("state_home")
    if report.when == "call" and report.failed and home is not None:
        for log in sorted((Path(home) / "logs").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-REPLICA_LOG_LINES:]
            report.sections.append((f"replica log {log.name} (last {len(lines)} lines)", "\n".join(lines)))
    return report


@pytest.fixture(scope="session", autouse=True)
def sky_catalog_dir(tmp_path_factory) -> Path:
    """SkyPilot's catalogs for this test run live in a temporary folder (seeded from the shipped
    snapshot), never in the user's ~/.sky or state home; subprocesses inherit it."""
    path = tmp_path_factory.mktemp("sky")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPOT_ORCHESTRATOR_SKY_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def replica_runtime() -> Path:
    """The replica runtime's python (vLLM CPU build); skips the test when unavailable."""
    reason = _replica_has_vllm()
    if reason:
        pytest.skip(reason)
    return REPLICA_PYTHON


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """One demo-model cache for the whole run (building it takes a few seconds)."""
    explicit = os.environ.get("SPOT_ORCHESTRATOR_MODELS")
    return Path(explicit) if explicit else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(replica_runtime, models_dir) -> Path:
    out = subprocess.run(
        [str(replica_runtime), "-m", "orchestrator.replica.demo_model", "--size", "tiny", "--root", str(models_dir)],
        capture_output=True, text=True, timeout=600, check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def state_home(tmp_path, monkeypatch, models_dir):
    """An isolated SPOT_ORCHESTRATOR_HOME (and daemon port) for one test."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("SPOT_ORCHESTRATOR_HOME", str(home))
    monkeypatch.setenv("SPOT_ORCHESTRATOR_DAEMON_PORT", str(free_port()))
    monkeypatch.setenv("SPOT_ORCHESTRATOR_MODELS", str(models_dir))
    yield home
    # Every spotctl verb starts a daemon when none runs: one a test started that way is
    # stopped here, not left running after the test.
    stop_autostarted_daemon()


@pytest.fixture(scope="module")
def moto_url():
    """moto's server (EC2, SQS, ...) on 127.0.0.1, for real boto3 clients (see helpers.moto_session)."""
    from moto.server import ThreadedMotoServer  # only the AWS tests pay for importing moto

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="module")
def moto_image(moto_url) -> str:
    """An AMI id moto knows (its AMI list is long: asked once per module)."""
    ec2 = moto_session().client("ec2", endpoint_url=moto_url)
    return ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
