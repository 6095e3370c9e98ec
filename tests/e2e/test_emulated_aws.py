"""`spotctl up templates/aws.yaml` on an emulated AWS that boots its VMs (tests/fakes/emulated_aws):
moto's EC2 server, each instance's user-data run as a machine with its own IMDSv2; a spot
interruption injected at one replica's IMDS mid-stream. See tests/e2e/emulated.py for the path."""

from __future__ import annotations

import pytest

from tests.e2e.emulated import emulated, walk
from tests.fakes.emulated_aws import EmulatedAWS
from tests.fakes.vm_runner import VMRunner
from tests.helpers import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]


@pytest.fixture
def aws(tmp_path, state_home, monkeypatch, models_dir, replica_runtime, tiny_model):
    with emulated(monkeypatch, EmulatedAWS(VMRunner(tmp_path / "vms", models_dir))) as emulator:
        yield emulator


def test_emulated_aws_replicas_boot_serve_survive_a_preemption_and_leave_nothing(aws, tmp_path):
    walk(aws, REPO / "templates" / "aws.yaml", tmp_path)
