"""`spotctl up templates/azure.yaml` on an emulated Azure that boots its VMs (tests/fakes/emulated_azure):
a Resource Manager fake, each VM's customData run as a machine with its own IMDS; a Preempt
scheduled event injected at one replica's IMDS mid-stream. See tests/e2e/emulated.py for the path."""

from __future__ import annotations

import pytest

from tests.e2e.emulated import emulated, walk
from tests.fakes.emulated_azure import EmulatedAzure
from tests.fakes.vm_runner import VMRunner
from tests.helpers import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]


@pytest.fixture
def azure(tmp_path, state_home, monkeypatch, models_dir, replica_runtime, tiny_model):
    with emulated(monkeypatch, EmulatedAzure(VMRunner(tmp_path / "vms", models_dir))) as emulator:
        yield emulator


def test_emulated_azure_replicas_boot_serve_survive_a_preemption_and_leave_nothing(azure, tmp_path):
    walk(azure, REPO / "templates" / "azure.yaml", tmp_path, grace_s=30.0)
