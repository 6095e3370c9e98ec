"""`spotctl up templates/<cloud>.yaml` on each emulated cloud that boots its VMs, one test per cloud:
- AWS (tests/fakes/emulated_aws): moto's EC2 server, each instance's user-data run as a machine
  with its own IMDSv2; the spot interruption warning injected at one replica's IMDS;
- GCP (tests/fakes/emulated_gcp): a Compute Engine API fake, each VM's startup-script run as a
  machine with its own metadata server; `instance/preempted` flipped at one replica's;
- Azure (tests/fakes/emulated_azure): a Resource Manager fake, each VM's customData run as a
  machine with its own IMDS; a Preempt scheduled event posted at one replica's.
Mid-stream, as tests/e2e/emulated.py walks it."""

from __future__ import annotations

import pytest

from tests.e2e.emulated import emulated, walk
from tests.fakes.emulated_aws import EmulatedAWS
from tests.fakes.emulated_azure import EmulatedAzure
from tests.fakes.emulated_gcp import EmulatedGCP
from tests.fakes.vm_runner import VMRunner
from tests.helpers import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

EMULATORS = {"aws": EmulatedAWS, "gcp": EmulatedGCP, "azure": EmulatedAzure}
# The notice each cloud gives (AWS two minutes; GCP and Azure about 30 s).
GRACE_S = {"aws": 90.0, "gcp": 30.0, "azure": 30.0}


@pytest.mark.parametrize("cloud", sorted(EMULATORS))
def test_emulated_cloud_replicas_boot_serve_survive_a_preemption_and_leave_nothing(
        cloud, tmp_path, state_home, monkeypatch, models_dir, replica_runtime, tiny_model):
    with emulated(monkeypatch, EMULATORS[cloud](VMRunner(tmp_path / "vms", models_dir))) as emulator:
        walk(emulator, REPO / "templates" / f"{cloud}.yaml", tmp_path, grace_s=GRACE_S[cloud])
