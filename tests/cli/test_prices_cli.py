"""`spotctl prices` as a user runs it: a subprocess with HOME in tmp_path and no credentials, so it
is offline and must fall back to SkyPilot's catalog (seeded from the shipped snapshot) in one line;
`--refresh` fetches catalogs from a local HTTP mirror."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from orchestrator.common.paths import REPO_ROOT
from providers.catalog import loader
from tests.fakes.clouds import serve

CLOUD_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_", "CLOUDSDK_", "GCE_", "ARM_")


@pytest.fixture
def env(tmp_path):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(CLOUD_ENV_PREFIXES)
             and k not in (loader.SKY_DIR_ENV, loader.CATALOG_URL_ENV)}  # sky's catalogs: under the state home
    clean.update(HOME=str(tmp_path), SPOT_ORCHESTRATOR_HOME=str(tmp_path / "state"),
                 AWS_EC2_METADATA_DISABLED="true", NO_GCE_CHECK="true", COLUMNS="200")
    return clean


def spotctl(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "prices", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_offline_table_is_non_empty_and_says_why_in_one_line(env):
    result = spotctl(env)
    assert result.returncode == 0, result.stderr
    assert "spot $/h" in result.stdout and "on-demand $/h" in result.stdout and "more rows" in result.stdout
    assert "source" in result.stdout and "snapshot" in result.stdout
    assert sum(line.startswith("│") for line in result.stdout.splitlines()) == 40  # the default --limit
    assert result.stderr.count("\n") == 1 and "no credentials for aws, gcp, azure" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_json_rows_are_gpu_offers_with_spot_below_on_demand_cheapest_first(env):
    result = spotctl(env, "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert len(rows) > 100
    keys = {"cloud", "region", "zone", "instance_type", "accelerator", "accelerator_count", "spot_price",
            "on_demand_price", "observed_at", "source", "age_s", "spot", "on_demand"}
    assert all(keys <= set(row) for row in rows)
    assert {row["cloud"] for row in rows} == {"aws", "gcp", "azure"}
    assert all(row["accelerator_count"] >= 1 and row["accelerator"] for row in rows)
    assert all(row["source"] == "snapshot" and row["observed_at"] == loader.SHIPPED_SNAPSHOT_AT for row in rows)
    priced = [row for row in rows if row["spot_price"] is not None]
    assert len(priced) > 0.9 * len(rows) and all(row["spot_price"] < row["on_demand_price"] for row in priced)
    best = [row["spot_price"] for row in priced]
    assert best == sorted(best)


def test_gcp_a100_on_demand_is_the_list_price(env):
    """GCP lists a2-highgpu-1g in us-central1 at about $3.67/h (host + A100), not the host's $0.74."""
    rows = json.loads(spotctl(env, "--gpu", "A100", "--json").stdout)
    a2 = [r for r in rows if (r["cloud"], r["region"], r["instance_type"]) == ("gcp", "us-central1", "a2-highgpu-1g")]
    assert {r["zone"] for r in a2} == {"us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"}
    assert all(r["on_demand_price"] == pytest.approx(3.67, rel=0.05) for r in a2)
    aws = next(r for r in rows if (r["cloud"], r["region"], r["instance_type"]) == ("aws", "us-east-1", "p4d.24xlarge"))
    assert aws["on_demand_price"] / 8 < a2[0]["on_demand_price"]  # per GPU, as the clouds price them today


def test_filters(env):
    rows = json.loads(spotctl(env, "--gpu", "a100:1", "--cloud", "gcp", "--json").stdout)
    assert rows and all((r["cloud"], r["accelerator"], r["accelerator_count"]) == ("gcp", "A100", 1) for r in rows)
    rows = json.loads(spotctl(env, "--cloud", "aws", "--region", "us-east-1,us-west-2", "--spot-only", "--json").stdout)
    assert rows and {r["region"] for r in rows} == {"us-east-1", "us-west-2"}
    assert all(r["spot_price"] is not None for r in rows)
    eight = json.loads(spotctl(env, "--gpu", "H100:8", "--json").stdout)
    assert eight and {r["cloud"] for r in eight} >= {"aws", "azure"} and all(r["accelerator_count"] == 8 for r in eight)


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu", "A100:x"], "--gpu"),
    (["--gpu", ":8"], "--gpu"),
    (["--cloud", "aws,ibm"], "--cloud"),
    (["--history", "no-slash"], "--history"),
])
def test_bad_input_is_one_line_exit_2(env, args, message):
    result = spotctl(env, *args)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_refresh_fetches_catalogs_and_says_what_failed(env):
    fresh = ("InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,"
             "AvailabilityZone,Arch\n"
             "g5.xlarge,A10G,1.0,4.0,16.0,\"{'Gpus': [{'MemoryInfo': {'SizeInMiB': 24576}}]}\",1.006,0.1234,us-east-1,"
             "use1-az9,x86_64\nm5.large,,,2.0,8.0,,0.096,0.04,us-east-1,use1-az1,x86_64\n")

    def mirror(req):
        return (200, fresh) if req.path == "/v8/aws/vms.csv" else (404, "no such catalog")

    with serve(mirror) as server:
        env[loader.CATALOG_URL_ENV] = server.url
        result = spotctl(env, "--refresh", "--cloud", "aws,gcp", "--json")
    assert result.returncode == 0, result.stderr
    assert "gcp: catalog not refreshed (HTTP 404" in result.stderr and "Traceback" not in result.stderr
    rows = json.loads(result.stdout)
    aws = [r for r in rows if r["cloud"] == "aws"]
    assert [(r["instance_type"], r["zone"], r["spot_price"], r["source"]) for r in aws] == [
        ("g5.xlarge", "use1-az9", 0.1234, "catalog")]
    assert aws[0]["observed_at"] == pytest.approx(time.time(), abs=600)
    assert {r["source"] for r in rows if r["cloud"] == "gcp"} == {"snapshot"}  # kept after the failed refresh
    again = json.loads(spotctl(env, "--cloud", "aws", "--json").stdout)  # the refreshed file stays
    assert [r["source"] for r in again] == ["catalog"]


def test_history_shows_stored_quotes(env, tmp_path, monkeypatch):
    monkeypatch.setenv("SPOT_ORCHESTRATOR_HOME", env["SPOT_ORCHESTRATOR_HOME"])
    from orchestrator.control.pricebook import record_history
    from orchestrator.control.store import Store
    from providers.base import Location, Market, Offer

    store = Store()
    loc = Location("aws", "us-east-1", "us-east-1a")
    record_history(store, [Offer(loc, "p4d.24xlarge", "A100", 8, Market.SPOT, p, 1_796_000_000.0 + i * 60)
                           for i, p in enumerate([9.5, 9.1, 10.2])])
    record_history(store, [Offer(loc, "g5.xlarge", "A10G", 1, Market.SPOT, 0.4, 1_796_000_000.0)])
    store.close()
    result = spotctl(env, "--history", "us-east-1a/p4d.24xlarge", "--json")
    assert result.returncode == 0, result.stderr
    assert [q["price_per_hour"] for q in json.loads(result.stdout)] == [9.5, 9.1, 10.2]
    table = spotctl(env, "--history", "us-east-1a/p4d.24xlarge")
    assert "10.2000" in table.stdout and "spot" in table.stdout
    empty = spotctl(env, "--history", "nowhere/none")
    assert empty.returncode == 0 and "no stored price history" in empty.stdout
