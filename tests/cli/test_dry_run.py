"""`spotctl up --dry-run [--json]`: the launches a spec would get, offline, with no daemon."""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO, spotctl

TEMPLATES = REPO / "templates"


def _plan(*args: str) -> list[dict]:
    return json.loads(spotctl("up", *args, "--dry-run", "--json").stdout)


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_each_cloud_template_plans_instances_that_carry_its_accelerator(cloud, state_home):
    from orchestrator.spec import load_spec

    spec = load_spec(TEMPLATES / f"{cloud}.yaml")
    wanted = {(name.lower(), count) for name, count in spec.accelerators_wanted()}
    plan = _plan(str(TEMPLATES / f"{cloud}.yaml"))
    assert len(plan) >= spec.min_replicas
    for launch in plan:
        assert launch["cloud"] == cloud and launch["instance_type"] and launch["zone"]
        assert (launch["accelerator"].lower(), launch["accelerator_count"]) in wanted
        assert launch["market"] in ("spot", "on_demand") and launch["price_per_hour"] > 0
        assert launch["price_source"] in ("snapshot", "catalog") and launch["boot_script_bytes"] > 500
    assert not (state_home / "daemon.json").exists(), "a dry run must not start the daemon"


def test_a_region_only_and_a_cloud_only_spec_get_zones_of_their_own(tmp_path, state_home):
    region_only = tmp_path / "r.yaml"
    region_only.write_text("name: r\nservice: {replicas: 2}\nresources: {infra: aws/us-west-2, accelerators: L4:1, "
                           "use_spot: true}\nengine: {model: m}\n")
    plan = _plan(str(region_only))
    assert {p["region"] for p in plan} == {"us-west-2"} and all(p["zone"] for p in plan)
    assert {p["instance_type"].split(".")[0] for p in plan} == {"g6"}
    cloud_only = tmp_path / "c.yaml"
    cloud_only.write_text("name: c\nservice: {replicas: 1}\nresources: {cloud: gcp, accelerators: A100:1}\n"
                          "engine: {model: m}\n")
    (a100,) = _plan(str(cloud_only))
    # On demand (no use_spot), the cheapest a2-highgpu-1g anywhere, priced host + GPU (the host
    # alone is about $0.74/h; GCP's cheapest regions list the whole machine at about $2.4/h).
    assert a100["instance_type"] == "a2-highgpu-1g" and a100["market"] == "on_demand"
    assert a100["price_per_hour"] > 2.0


def test_a_dry_run_names_what_is_wrong_in_one_line(tmp_path, state_home):
    nothing = tmp_path / "n.yaml"
    nothing.write_text("name: n\nresources: {cloud: aws, region: us-east-1, accelerators: TPU-v9:1}\n"
                       "engine: {model: m}\n")
    out = spotctl("up", str(nothing), "--dry-run", check=False)
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0
    assert "no offer for TPU-v9:1" in out.stderr
    unknown = tmp_path / "u.yaml"
    unknown.write_text("name: u\nresources: {cloud: awz}\nengine: {model: m}\n")
    out = spotctl("up", str(unknown), "--dry-run", check=False)
    assert "unknown cloud 'awz'; did you mean 'aws'?" in out.stderr


def test_one_service_is_planned_across_clouds_when_the_cheapest_markets_are_on_different_clouds(tmp_path,
                                                                                                state_home):
    """templates/multi-cloud.yaml over AWS, GCP and Azure: with AWS's cheapest L4 zone priced below
    GCP's (a catalog the test writes), the spot replicas spread over both clouds' cheapest zones
    (the cheapest calm markets are on different clouds)."""
    import os
    import shutil

    from providers.catalog import loader

    sky = tmp_path / "sky" / ".sky" / "catalogs" / "v8"
    for cloud in ("aws", "gcp", "azure"):
        (sky / cloud).mkdir(parents=True)
        shutil.copy(loader.SHIPPED_DIR / cloud / "vms.csv", sky / cloud / "vms.csv")
    aws = sky / "aws" / "vms.csv"
    lines = aws.read_text().splitlines()
    cheap = [i for i, line in enumerate(lines) if line.startswith("g6.xlarge,") and ",us-east-1," in line][:1]
    assert cheap, "the snapshot lists g6.xlarge in us-east-1"
    for i in cheap:  # one AWS zone cheaper than GCP's 0.28 L4 spot, the others dearer than it
        fields = lines[i].split(",")
        fields[-4] = "0.1500"
        lines[i] = ",".join(fields)
    aws.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "SPOT_ORCHESTRATOR_SKY_DIR": str(tmp_path / "sky")}
    out = spotctl("up", str(TEMPLATES / "multi-cloud.yaml"), "--dry-run", "--json", env=env)
    plan = json.loads(out.stdout)
    spot = [p for p in plan if p["market"] == "spot"]
    assert {p["cloud"] for p in spot} == {"aws", "gcp"}, plan
    assert min(spot, key=lambda p: p["price_per_hour"])["cloud"] == "aws"
    # As its comment says: min_replicas + num_overprovision spot replicas (no cloud's notices
    # are trusted yet), one per zone, each reason naming its market; on-demand only as covers
    # of the first cold start, never more than the target.
    assert len(spot) == 3 + 1 and len({(p["cloud"], p["zone"]) for p in spot}) == len(spot)
    assert all(f"in {p['cloud']}/{p['region']}/{p['zone']}" in p["reason"] for p in spot), plan
    od = [p for p in plan if p["market"] == "on_demand"]
    assert len(od) <= 3 and all(p["reason"].startswith("on-demand cover") for p in od), plan
