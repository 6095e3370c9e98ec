"""`spotctl up templates/gcp.yaml` on an emulated GCP that boots its VMs (tests/fakes/emulated_gcp):
a Compute Engine API fake, each instance's startup-script run as a machine with its own metadata
server; a preemption injected at one replica's metadata server mid-stream. See
tests/e2e/emulated.py for the path."""

from __future__ import annotations

import pytest

from tests.e2e.emulated import emulated, walk
from tests.fakes.emulated_gcp import EmulatedGCP
from tests.fakes.vm_runner import VMRunner
from tests.helpers import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]


@pytest.fixture
def gcp(tmp_path, state_home, monkeypatch, models_dir, replica_runtime, tiny_model):
    with emulated(monkeypatch, EmulatedGCP(VMRunner(tmp_path / "vms", models_dir))) as emulator:
        yield emulator


def test_emulated_gcp_replicas_boot_serve_survive_a_preemption_and_leave_nothing(gcp, tmp_path):
    walk(gcp, REPO / "templates" / "gcp.yaml", tmp_path, grace_s=30.0)
