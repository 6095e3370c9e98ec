"""One service over two emulated clouds at once (AWS: moto + booted VMs; GCP: the Compute fake +
booted VMs): `spotctl up` of a spec whose `any_of` names both, replicas READY on both behind one
load balancer, the busiest spot replica's whole zone preempted at its own cloud's metadata
service mid-stream, every client stream whole, replacements launched, and `spotctl down`
leaving nothing on either cloud. See tests/e2e/emulated.py for the path."""

from __future__ import annotations

import pytest

from tests.e2e.emulated import Together, emulated, walk
from tests.fakes.emulated_aws import EmulatedAWS
from tests.fakes.emulated_gcp import EmulatedGCP
from tests.fakes.vm_runner import VMRunner

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

SPEC = """
name: multi
service:
  readiness_probe: {path: /v1/models, initial_delay_seconds: 1200}
resources:
  accelerators: L4:1
  use_spot: true
  any_of:
    - infra: aws/us-east-1
    - infra: gcp/us-central1/us-central1-a
engine: {model: meta-llama/Llama-3.1-8B-Instruct}
"""


@pytest.fixture
def clouds(tmp_path, state_home, monkeypatch, models_dir, replica_runtime, tiny_model):
    runner = VMRunner(tmp_path / "vms", models_dir)
    with emulated(monkeypatch, Together(EmulatedAWS(runner), EmulatedGCP(runner))) as together:
        yield together


def test_emulated_multi_cloud_service_spans_two_clouds_and_survives_one_clouds_zone_preempted(clouds, tmp_path):
    (tmp_path / "spec").mkdir()
    template = tmp_path / "spec" / "multi.yaml"
    template.write_text(SPEC)
    walk(clouds, template, tmp_path, grace_s=30.0, clouds={"aws", "gcp"})
