"""The local cloud with real processes: launch, list, idempotency, terminate, notices, restart."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from orchestrator.common.procs import MACHINE_NICE
from providers.base import (
    TAG_REPLICA,
    TAG_SERVICE,
    CapacityError,
    InstanceStatus,
    LaunchRequest,
    Location,
    Market,
    NoticeKind,
    ProviderError,
)
from providers.local import NOTICE_FILE_ENV, LocalProvider, ZonePrices, configured_locations
from tests.helpers import alive, free_port, wait_for

# A tiny HTTP server on {port} that also starts a grandchild in its process group, and
# writes both pids to $PID_FILE, so a test can check that nothing survives.
SERVER = """
import http.server, os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.environ["PID_FILE"], "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
print("serving on", sys.argv[1], "env", os.environ["MY_PORT"], flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()
"""
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOT_ORCHESTRATOR_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def cloud(home):
    provider = LocalProvider(stop_timeout_s=2.0)
    yield provider
    for inst in LocalProvider().list():  # never leave a process behind, whatever failed
        provider.terminate(inst.instance_id)
    provider.close()


def request(tmp_path, replica="chat-1", zone="local-a", market=Market.SPOT, command=None, **kw):
    pid_file = tmp_path / f"{replica}.pids"
    return LaunchRequest(
        service="chat",
        replica_id=replica,
        location=Location("local", "local", zone),
        market=market,
        instance_type="local-cpu",
        command=command or [sys.executable, "-c", SERVER, "{port}"],
        env={"PID_FILE": str(pid_file), "MY_PORT": "{port}"},
        **kw,
    )


def pids(tmp_path, replica="chat-1") -> list[int]:
    path = tmp_path / f"{replica}.pids"
    text = wait_for(lambda: path.exists() and path.read_text(), what=f"{path}")
    return [int(p) for p in text.split()]


def environ(pid: int) -> dict[str, str]:
    return psutil.Process(pid).environ()


def get_ok(endpoint: str) -> bool:
    try:
        return httpx.get(endpoint + "/", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_offers_both_markets_per_zone(cloud):
    offers = cloud.offers()
    assert {o.location.zone for o in offers} == {"local-a", "local-b", "local-c"}
    for zone in ("local-a", "local-b", "local-c"):
        spot = [o for o in offers if o.location.zone == zone and o.market is Market.SPOT]
        od = [o for o in offers if o.location.zone == zone and o.market is Market.ON_DEMAND]
        assert len(spot) == len(od) == 1 and spot[0].price_per_hour < od[0].price_per_hour
    assert cloud.offers("cpu") and cloud.offers("A100") == [] and cloud.offers("CPU", 2) == []
    cloud.set_price("local-a", Market.SPOT, 0.11)
    assert min(o.price_per_hour for o in LocalProvider().offers()) == 0.11  # persisted for others


def test_configurable_zones_and_accelerator(home, tmp_path):
    provider = LocalProvider(
        tmp_path / "c", zones={"z1": ZonePrices(0.1, 0.5), "z2": ZonePrices(0.2, 0.5)}, accelerator="T4"
    )
    assert [o.accelerator for o in provider.offers("t4")] == ["T4"] * 4
    assert configured_locations(tmp_path / "c") == [Location("local", "local", "z1"), Location("local", "local", "z2")]
    assert [loc.zone for loc in LocalProvider(tmp_path / "d", zones=["x", "y"]).locations()] == ["x", "y"]
    assert [loc.zone for loc in configured_locations(tmp_path / "nothing-here")] == ["local-a", "local-b", "local-c"]


def test_launch_list_get_and_terminate_leaves_no_process(cloud, tmp_path):
    inst = cloud.launch(request(tmp_path, tags={"team": "x"}))
    assert inst.status is InstanceStatus.RUNNING
    assert inst.instance_id.startswith("local-") and inst.location.zone == "local-a"
    assert inst.tags[TAG_SERVICE] == "chat" and inst.tags[TAG_REPLICA] == "chat-1" and inst.tags["team"] == "x"
    assert inst.price_per_hour == 0.30 and inst.market is Market.SPOT
    assert inst.agent_endpoint and inst.agent_endpoint != inst.endpoint
    wait_for(lambda: get_ok(inst.endpoint), what="the server on {port}")
    leader, grandchild = pids(tmp_path)
    assert alive(leader) and alive(grandchild)
    # A machine of its own in a real cloud: here it yields the CPUs to the control plane.
    assert os.getpriority(os.PRIO_PROCESS, leader) == os.getpriority(os.PRIO_PROCESS, grandchild) == MACHINE_NICE
    scratch = Path(environ(leader)["TMPDIR"])  # the machine's own disk
    assert scratch.is_dir() and environ(grandchild)["TMPDIR"] == str(scratch)
    (scratch / "engine.sock").write_bytes(b"")  # what a killed vLLM leaves behind
    log = cloud.log_path(inst.instance_id)
    port = inst.endpoint.rsplit(":", 1)[1]
    wait_for(lambda: f"serving on {port} env {port}" in log.read_text(), what="log line")  # {port} in args and env

    assert [i.instance_id for i in cloud.list({TAG_SERVICE: "chat"})] == [inst.instance_id]
    assert cloud.list({TAG_SERVICE: "other"}) == []
    assert cloud.get(inst.instance_id).status is InstanceStatus.RUNNING
    assert cloud.get("local-nope") is None

    cloud.terminate(inst.instance_id)
    assert not alive(leader) and not alive(grandchild)
    assert not scratch.exists()
    assert cloud.get(inst.instance_id).status is InstanceStatus.TERMINATED
    assert not get_ok(inst.endpoint)
    cloud.terminate(inst.instance_id)  # again: no error
    cloud.terminate("local-missing")


def test_launch_is_idempotent_on_client_token(cloud, tmp_path):
    first = cloud.launch(request(tmp_path))
    again = cloud.launch(request(tmp_path))
    assert again.instance_id == first.instance_id and again.endpoint == first.endpoint
    assert len(cloud.list()) == 1
    other = cloud.launch(request(tmp_path, replica="chat-2", zone="local-b", market=Market.ON_DEMAND))
    assert other.instance_id != first.instance_id and other.price_per_hour == 1.00
    assert len(cloud.list({TAG_SERVICE: "chat"})) == 2


def test_explicit_port(cloud, tmp_path):
    port = free_port()
    inst = cloud.launch(request(tmp_path, port=port))
    assert inst.endpoint == f"http://127.0.0.1:{port}"
    wait_for(lambda: get_ok(inst.endpoint), what="server on the requested port")


def test_sigterm_ignored_gets_sigkill(cloud, tmp_path):
    inst = cloud.launch(request(tmp_path, command=[sys.executable, "-c", STUBBORN]))
    wait_for(lambda: "up" in cloud.log_path(inst.instance_id).read_text(), what="stubborn process up")
    pid = json.loads((cloud.root / "instances" / f"{inst.instance_id}.json").read_text())["pid"]
    cloud.terminate(inst.instance_id)  # SIGTERM is ignored: SIGKILL after stop_timeout_s
    assert not alive(pid)
    assert cloud.get(inst.instance_id).status is InstanceStatus.TERMINATED


def test_process_that_dies_reads_terminated_and_takes_its_group(cloud, tmp_path):
    inst = cloud.launch(request(tmp_path))
    leader, grandchild = pids(tmp_path)
    scratch = Path(environ(leader)["TMPDIR"])
    os.kill(leader, signal.SIGKILL)
    wait_for(lambda: cloud.get(inst.instance_id).status is InstanceStatus.TERMINATED, what="TERMINATED")
    assert not alive(grandchild) and not scratch.exists()  # the "machine" is gone, with everything on it
    assert [i.status for i in cloud.list()] == [InstanceStatus.TERMINATED]


def test_notice_then_kill_at_deadline(cloud, tmp_path):
    inst = cloud.launch(request(tmp_path))
    leader, grandchild = pids(tmp_path)
    scratch = Path(environ(leader)["TMPDIR"])
    notice = cloud.inject_notice(inst.instance_id, grace_s=2.0)
    assert notice.kind is NoticeKind.PREEMPT and notice.deadline > time.time() - 1
    # the replica can see it too, in the file named by its environment
    replica_view = json.loads((cloud.root / "notices" / f"{inst.instance_id}.json").read_text())
    assert replica_view["action"] == "terminate" and replica_view["deadline"] == notice.deadline
    delivered = cloud.notices()
    assert [(n.instance_id, n.deadline) for n in delivered] == [(inst.instance_id, notice.deadline)]
    assert cloud.notices() == [] and LocalProvider().notices() == []  # exactly once, for everyone
    status = cloud.get(inst.instance_id).status
    if time.time() < notice.deadline:  # (a loaded machine may already be past it)
        assert status is InstanceStatus.RUNNING  # a notice alone kills nothing
    wait_for(lambda: not alive(leader) and not alive(grandchild), timeout=30, what="kill at the deadline")
    assert cloud.get(inst.instance_id).status is InstanceStatus.TERMINATED
    assert not scratch.exists()


def test_notice_env_and_rebalance_does_not_kill(cloud, tmp_path):
    script = f"import os, time; print(os.environ['{NOTICE_FILE_ENV}'], flush=True); time.sleep(600)"
    inst = cloud.launch(request(tmp_path, command=[sys.executable, "-c", script]))
    log = cloud.log_path(inst.instance_id)
    wait_for(lambda: log.read_text().strip(), what="notice path printed")
    cloud.inject_notice(inst.instance_id, grace_s=0.2, kind=NoticeKind.REBALANCE)
    assert Path(log.read_text().strip()).exists()
    time.sleep(0.5)
    assert cloud.get(inst.instance_id).status is InstanceStatus.RUNNING
    assert [n.kind for n in cloud.notices()] == [NoticeKind.REBALANCE]


def test_restarted_provider_finds_instances_and_keeps_deadlines(cloud, tmp_path):
    a = cloud.launch(request(tmp_path))
    b = cloud.launch(request(tmp_path, replica="chat-2", zone="local-b"))
    b_leader, _ = pids(tmp_path, "chat-2")
    cloud.inject_notice(b.instance_id, grace_s=1.5)
    cloud.close()  # the daemon goes away; its timers with it
    restarted = LocalProvider()
    try:
        found = {i.instance_id: i for i in restarted.list({TAG_SERVICE: "chat"})}
        assert set(found) == {a.instance_id, b.instance_id}
        assert found[a.instance_id].status is InstanceStatus.RUNNING
        assert found[a.instance_id].endpoint == a.endpoint
        assert [n.instance_id for n in restarted.notices()] == [b.instance_id]  # not yet delivered
        wait_for(lambda: not alive(b_leader), timeout=30, what="the restarted provider's kill")
        assert restarted.get(b.instance_id).status is InstanceStatus.TERMINATED
        assert restarted.get(a.instance_id).status is InstanceStatus.RUNNING
    finally:
        restarted.close()


def test_deadline_passed_while_nobody_ran_is_enforced_on_read(cloud, tmp_path):
    inst = cloud.launch(request(tmp_path))
    leader, _ = pids(tmp_path)
    notice = cloud.inject_notice(inst.instance_id, grace_s=0.5)
    cloud.close()  # no timer will fire
    wait_for(lambda: time.time() > notice.deadline + 0.1, what="the deadline to pass")
    assert alive(leader)  # nobody has looked yet
    # a new provider object reading the registry kills what is overdue, whatever timers ran
    assert LocalProvider().get(inst.instance_id).status is InstanceStatus.TERMINATED
    assert not alive(leader)


def test_capacity_limits_and_zone_preemption(cloud, tmp_path):
    cloud.set_capacity("local-a", Market.SPOT, 1)
    cloud.launch(request(tmp_path, replica="chat-1"))
    with pytest.raises(CapacityError) as info:
        cloud.launch(request(tmp_path, replica="chat-2"))
    assert info.value.location == Location("local", "local", "local-a") and info.value.market is Market.SPOT
    assert "\n" not in str(info.value)
    cloud.launch(request(tmp_path, replica="chat-3", market=Market.ON_DEMAND))  # other market: fine
    cloud.launch(request(tmp_path, replica="chat-4", zone="local-b"))  # other zone: fine
    cloud.set_capacity("local-a", Market.SPOT, None)
    cloud.launch(request(tmp_path, replica="chat-5"))

    notices = cloud.preempt_zone("local-a", grace_s=60)
    hit = {cloud.get(n.instance_id).tags[TAG_REPLICA] for n in notices}
    assert hit == {"chat-1", "chat-5"}  # spot in local-a only
    later = cloud.inject_notice(notices[0].instance_id, grace_s=600)
    assert later.deadline == notices[0].deadline  # a second notice never postpones the kill
    with pytest.raises(ProviderError, match="no zone 'local-z'"):
        cloud.preempt_zone("local-z", 1)


def test_bad_launches_are_one_line_errors(cloud, tmp_path):
    with pytest.raises(ProviderError, match="no zone 'local-q'"):
        cloud.launch(request(tmp_path, zone="local-q"))
    with pytest.raises(ProviderError, match="cannot run '/nonexistent/python'"):
        cloud.launch(request(tmp_path, command=["/nonexistent/python", "-V"]))
    bad_region = LaunchRequest(
        "chat", "chat-9", Location("aws", "us-east-1", "us-east-1a"), Market.SPOT, "x", command=["true"]
    )
    with pytest.raises(ProviderError, match="cannot launch in aws/us-east-1/us-east-1a"):
        cloud.launch(bad_region)
    empty = LaunchRequest("chat", "chat-8", Location("local", "local", "local-a"), Market.SPOT, "x")
    with pytest.raises(ProviderError, match="no command"):
        cloud.launch(empty)
    with pytest.raises(ProviderError, match="no running local instance"):
        cloud.inject_notice("local-nope", 1)
    assert cloud.list() == []
