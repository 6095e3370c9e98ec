"""A steady service whose rows nobody wrote is reconciled and probed every QUIET_EVERY-th pass
(staggered by name), and at the next pass after any write: what keeps a daemon of a thousand
quiet services cheap (tests/benchmarks/bench_daemon_scale.py). The daemon's jobs are driven by
hand here, each pass's services run inline, so the counts are exact."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import yaml

from orchestrator.control import daemon as daemon_module
from orchestrator.control.daemon import Daemon
from orchestrator.control.store import Store
from orchestrator.spec import parse_spec
from providers.local import LocalProvider
from tests.control.test_daemon import SPEC, FakeEngineLauncher
from tests.helpers import wait_for


class InlinePool:
    """A reconcile pool that runs each service's pass at once, in the caller's thread."""

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        future.set_result(fn(*args))
        return future

    def shutdown(self, **_kwargs) -> None:
        return None


@pytest.fixture
def steady(state_home):
    """A daemon (no jobs running) with service `svc` READY and steady."""
    d = Daemon(store=Store(), launcher=FakeEngineLauncher())
    d._reconcile_pool = InlinePool()
    probed: list[int] = []  # targets per probe pass (svc is the only service)
    check = d.prober.check
    d.prober.check = lambda targets: probed.append(len(targets)) or check(targets)
    try:
        d.apply_spec(parse_spec(yaml.safe_load(SPEC)))

        def settled() -> bool:
            d.probe_all()
            d.reconcile_all()
            return "svc" in d._quiet

        wait_for(settled, 120, "the service to be READY and steady", 0.3)
        yield d, probed
    finally:
        d.down("svc")
        wait_for(lambda: (d.reconcile_all(), d.store.get_service("svc"))[1] is None, 120, "svc to go down", 0.3)
        d.shutdown()
        LocalProvider().close()


def test_a_steady_service_is_passed_every_fifth_pass_and_at_once_after_a_write(steady):
    d, probed = steady
    controller = d.controllers["svc"]
    every = daemon_module.QUIET_EVERY
    before = controller.reconciles
    for _ in range(2 * every):
        d.reconcile_all()
    assert controller.reconciles - before == 2  # its turn came twice in ten passes

    probed.clear()
    for _ in range(2 * every):
        d.probe_all()
    assert sum(1 for n in probed if n) == 2  # its replicas were asked in two of the ten probe passes

    # A write (here: the service's row) makes the fleet's snapshot new: the next pass takes it.
    d.store.update_service("svc", endpoint=d.store.get_service("svc").endpoint)
    before = controller.reconciles
    d.reconcile_all()
    assert controller.reconciles == before + 1


def test_a_service_that_is_not_steady_is_passed_every_time(steady):
    d, _probed = steady
    controller = d.controllers["svc"]
    replica = d.store.list_replicas("svc")[0]
    d.store.update_replica(replica.replica_id, replica.version, state="NOT_READY", reason="a probe failed")
    before = controller.reconciles
    for _ in range(3):
        d.reconcile_all()
    assert controller.reconciles - before == 3  # a replica not READY: every pass, until it is
