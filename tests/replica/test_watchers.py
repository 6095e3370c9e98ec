"""Replica-side notice watchers against local fake metadata servers (real formats) and a fake
daemon API that records what it is told."""

from __future__ import annotations

import datetime as dt
import email.utils
import subprocess
import time

import pytest

from orchestrator.common.paths import REPO_ROOT, replica_python
from orchestrator.replica.watchers import NoticeReporter, WatchLoop, load_watcher
from providers.watch.aws import AWSWatcher
from providers.watch.azure import AzureWatcher
from providers.watch.gcp import GCPWatcher
from tests.fakes.clouds import serve

TOKEN = "s3cret"


class FakeDaemon:
    def __init__(self, fail_first: int = 0):
        self.notices: list[dict] = []
        self.fail_first = fail_first

    def route(self, req):
        if req.path != "/v1/notices" or req.method != "POST":
            return 404, {"detail": "no route"}
        if req.headers.get("authorization") != f"Bearer {TOKEN}":
            return 401, {"detail": "bad token"}
        if self.fail_first > 0:
            self.fail_first -= 1
            return 503, {"detail": "busy"}
        self.notices.append(req.json())
        return 202, {"accepted": True}


@pytest.fixture
def daemon():
    fake = FakeDaemon()
    with serve(fake.route) as server:
        fake.url = server.url
        yield fake


def _loop(watcher, daemon) -> WatchLoop:
    return WatchLoop(watcher, NoticeReporter(daemon.url, TOKEN), interval=0.05)


# ---- AWS IMDSv2 --------------------------------------------------------------------------


class FakeImds:
    def __init__(self):
        self.action: object = None  # None -> 404
        self.rebalance: object = None
        self.tokens_issued = 0

    def route(self, req):
        if req.method == "PUT" and req.path == "/latest/api/token":
            assert req.headers.get("x-aws-ec2-metadata-token-ttl-seconds")
            self.tokens_issued += 1
            return 200, "imds-token"
        if req.headers.get("x-aws-ec2-metadata-token") != "imds-token":
            return 401, ""
        doc = {"/latest/meta-data/instance-id": "i-0abc",
               "/latest/meta-data/spot/instance-action": self.action,
               "/latest/meta-data/events/recommendations/rebalance": self.rebalance}.get(req.path)
        if doc is None:
            return 404, "<?xml version=\"1.0\"?><Error><Code>NotFound</Code></Error>"
        return 200, doc


def test_aws_instance_action_and_rebalance_reported_once(daemon):
    imds = FakeImds()
    with serve(imds.route) as server:
        loop = _loop(AWSWatcher(server.url), daemon)
        assert loop.step() == [] and daemon.notices == []  # 404s: nothing to report
        imds.rebalance = {"noticeTime": "2026-12-01T10:00:00Z"}
        imds.action = {"action": "terminate", "time": "2026-12-01T10:02:00Z"}
        loop.step()  # one poll interval is enough
        for _ in range(3):
            loop.step()
        loop.close()
    kinds = {n["kind"]: n for n in daemon.notices}
    assert len(daemon.notices) == 2 and set(kinds) == {"preempt", "rebalance"}
    assert kinds["preempt"] == {"instance_id": "i-0abc", "kind": "preempt",
                                "source": "aws:imds:instance-action:terminate",
                                "deadline": dt.datetime(2026, 12, 1, 10, 2, tzinfo=dt.UTC).timestamp()}
    assert imds.tokens_issued == 1  # the IMDSv2 token is reused


def test_aws_malformed_bodies_are_ignored(daemon):
    imds = FakeImds()
    imds.action = "this is not json"
    imds.rebalance = {"unexpected": 1}
    with serve(imds.route) as server:
        loop = _loop(AWSWatcher(server.url, instance_id="i-1"), daemon)
        assert loop.step() == []
        imds.action = {"action": "stop", "time": "2026-12-01T10:02:00Z"}
        assert [n["kind"] for n in loop.step()] == ["preempt"]
        loop.close()


# ---- GCP metadata --------------------------------------------------------------------------


class FakeGceMetadata:
    def __init__(self):
        self.preempted = "FALSE"
        self.maintenance = "NONE"

    def route(self, req):
        if req.headers.get("metadata-flavor") != "Google":
            return 403, "Missing Metadata-Flavor:Google header."
        docs = {"preempted": self.preempted, "maintenance-event": self.maintenance,
                "zone": "projects/123456/zones/us-central1-a", "name": "so-chat-r1"}
        key = req.path.removeprefix("/computeMetadata/v1/instance/")
        return (200, docs[key]) if key in docs else (404, "not found")


def test_gcp_preempted_flag_reported_once(daemon):
    meta = FakeGceMetadata()
    with serve(meta.route) as server:
        loop = _loop(GCPWatcher(server.url, clock=lambda: 1000.0), daemon)
        assert loop.step() == []
        meta.preempted = "garbage"  # logged and ignored
        assert loop.step() == []
        meta.preempted = "TRUE"
        loop.step()
        loop.step()
        meta.maintenance = "TERMINATE_ON_HOST_MAINTENANCE"
        loop.step()
        loop.close()
    assert [(n["instance_id"], n["kind"], n["deadline"]) for n in daemon.notices] == [
        ("us-central1-a/so-chat-r1", "preempt", 1030.0), ("us-central1-a/so-chat-r1", "maintenance", 1060.0)]


# ---- Azure Scheduled Events ------------------------------------------------------------------


class FakeScheduledEvents:
    def __init__(self):
        self.doc: object = {"DocumentIncarnation": 0, "Events": []}
        self.acks: list[dict] = []

    def route(self, req):
        if req.headers.get("metadata") != "true":
            return 400, {"error": "Bad request. Required metadata header not specified"}
        if req.path == "/metadata/instance/compute/name":
            return 200, "so-chat-r1"
        assert req.path == "/metadata/scheduledevents" and req.query["api-version"] == "2020-07-01"
        if req.method == "POST":
            self.acks.append(req.json())
            return 200, ""
        return 200, self.doc


def _preempt(event_id: str, resources: list[str], not_before: float) -> dict:
    return {"EventId": event_id, "EventType": "Preempt", "ResourceType": "VirtualMachine", "Resources": resources,
            "EventStatus": "Scheduled", "NotBefore": email.utils.formatdate(not_before, usegmt=True),
            "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}


def test_azure_preempt_reported_and_acknowledged_when_drained(daemon):
    events = FakeScheduledEvents()
    now = time.time()
    drained = [False]
    with serve(events.route) as server:
        watcher = AzureWatcher(server.url, drained=lambda: drained[0])
        loop = _loop(watcher, daemon)
        assert loop.step() == []
        events.doc = {"DocumentIncarnation": 1, "Events": [
            _preempt("A1", ["so-chat-r1"], now + 30), _preempt("B2", ["someone-else"], now + 30),
            {"EventId": "C3", "EventType": "Freeze", "Resources": [], "NotBefore": ""}]}
        loop.step()
        loop.step()
        assert events.acks == []  # not drained, NotBefore far away: never shorten the window
        drained[0] = True
        loop.step()
        loop.close()
    assert sorted((n["kind"], n["instance_id"]) for n in daemon.notices) == [
        ("maintenance", "so-chat-r1"), ("preempt", "so-chat-r1")]
    preempt = next(n for n in daemon.notices if n["kind"] == "preempt")
    assert preempt["deadline"] == pytest.approx(int(now + 30))
    assert events.acks == [{"StartRequests": [{"EventId": "A1"}]}] and watcher.acknowledged == ["A1"]


def test_azure_acknowledges_just_before_not_before(daemon):
    events = FakeScheduledEvents()
    events.doc = {"DocumentIncarnation": 2, "Events": [_preempt("D4", [], 1000.0)]}
    with serve(events.route) as server:
        loop = _loop(AzureWatcher(server.url, instance_id="vm", clock=lambda: 998.0), daemon)
        loop.step()
        loop.close()
    assert events.acks == [{"StartRequests": [{"EventId": "D4"}]}]


@pytest.mark.parametrize("doc", ["not json", {"Events": "nope"}, {"Events": [{"EventType": "Preempt"}]}, []])
def test_azure_malformed_documents_are_ignored(daemon, doc):
    events = FakeScheduledEvents()
    events.doc = doc
    with serve(events.route) as server:
        loop = _loop(AzureWatcher(server.url, instance_id="vm"), daemon)
        assert loop.step() == []
        loop.close()


# ---- delivery -----------------------------------------------------------------------------------


def test_refused_report_is_retried_on_next_poll():
    daemon = FakeDaemon(fail_first=1)
    meta = FakeGceMetadata()
    meta.preempted = "TRUE"
    with serve(daemon.route) as api, serve(meta.route) as server:
        loop = WatchLoop(GCPWatcher(server.url, instance_id="z/n"), NoticeReporter(api.url, TOKEN), interval=0.05)
        assert loop.step() == []  # daemon answered 503
        assert len(loop.step()) == 1
        assert loop.step() == []
        loop.close()
    assert len(daemon.notices) == 1


def test_wrong_token_is_never_marked_delivered(daemon):
    meta = FakeGceMetadata()
    meta.preempted = "TRUE"
    with serve(meta.route) as server:
        loop = WatchLoop(GCPWatcher(server.url, instance_id="z/n"), NoticeReporter(daemon.url, "wrong"))
        assert loop.step() == [] and loop.reported == set()
        loop.close()


def test_background_thread_delivers_and_stops(daemon):
    meta = FakeGceMetadata()
    with serve(meta.route) as server:
        loop = _loop(GCPWatcher(server.url, instance_id="z/n"), daemon)
        thread = loop.start()
        meta.preempted = "TRUE"
        deadline = time.monotonic() + 20
        while not daemon.notices and time.monotonic() < deadline:
            time.sleep(0.02)
        loop.close()
        thread.join(timeout=10)
    assert not thread.is_alive() and len(daemon.notices) == 1


def test_replica_runtime_loads_every_watcher_without_the_control_plane():
    """The agent finds each cloud's watcher by entry point in the replica environment, and
    loading them pulls in nothing of the control plane (only providers.watch, the in-VM half)."""
    python = replica_python()
    if not python.exists():
        pytest.skip(f"replica runtime missing at {python}")
    code = ("import sys, orchestrator.replica.watchers as w; "
            "names = w.watcher_names(); [w.load_watcher(n) for n in names]; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('sqlmodel', 'typer', 'boto3', 'sky', 'fastapi')"
            " or (m.startswith('providers.') and not m.startswith('providers.watch'))"
            " or (m.startswith('orchestrator.') and m.split('.')[1] not in ('replica', 'common'))]; "
            "sys.exit(f'control-plane imports: {bad}' if bad else 0 if names == ['aws', 'azure', 'gcp'] else names)")
    result = subprocess.run([str(python), "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr or result.stdout


def test_watcher_entry_point_group_is_the_registrys():
    from orchestrator.replica import watchers
    from providers import registry

    assert watchers.WATCHER_ENTRY_POINT_GROUP == registry.WATCHER_ENTRY_POINT_GROUP
    assert load_watcher("aws") is AWSWatcher and load_watcher("gcp") is GCPWatcher
    with pytest.raises(KeyError, match="no notice watcher 'nosuch'"):
        load_watcher("nosuch")
