"""Machines nobody owns: the daemon's sweep of its clouds, and the lost-state check at start.

Every machine carries its service, incarnation and replica id in its tags (providers.base).
The daemon (its `orphans` job, and once at start) lists the managed machines of every cloud it
uses; one whose service the store does not know, or whose incarnation is not the service's
current one, is an orphan: reported once (an "orphan" event and a log line), terminated after
`SPOT_ORCHESTRATOR_ORPHAN_GRACE_S` (at once by `spotctl down --all`). Machines of a known
service and incarnation are its controller's (it adopts or terminates the unrecorded ones).

The clouds in use are those of the stored services plus those remembered in `clouds.json`
beside the state database, so that a lost database still leaves a trace of where to look:
`check_state` refuses to start on a database that is missing, empty or unreadable while
managed machines run (`spotctl down --all --orphans` or restoring the file recovers).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable

from orchestrator.common import paths
from orchestrator.common.errors import UserError
from orchestrator.control.store import ServiceRow, Store, default_url
from orchestrator.spec import spec_from_json
from providers.base import TAG_MANAGED, Instance, InstanceStatus, Provider, ProviderError

log = logging.getLogger(__name__)

GRACE_ENV = "SPOT_ORCHESTRATOR_ORPHAN_GRACE_S"
DEFAULT_GRACE_S = 300.0  # long enough for an operator to notice the event and restore a lost state
RECOVER_HINT = ("restore the state database from a backup, or terminate the machines with "
                "`spotctl down --all --orphans`")


class StateLost(UserError):
    """The state database is gone or unreadable while machines it tracked still run."""

    exit_code = 1


def grace_s() -> float:
    return float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S))


def _clouds_file():
    return paths.home() / "clouds.json"


def remember_clouds(clouds: Iterable[str]) -> None:
    """Add clouds to the list kept beside the database (the daemon calls it at every `up`)."""
    known = remembered_clouds()
    wanted = sorted(known | set(clouds))
    if wanted != sorted(known):
        tmp = _clouds_file().with_suffix(".tmp")
        tmp.write_text(json.dumps(wanted))
        os.replace(tmp, _clouds_file())


def remembered_clouds() -> set[str]:
    try:
        return set(json.loads(_clouds_file().read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return set()


def clouds_in_use(store: Store | None) -> list[str]:
    """The stored services' clouds and the remembered ones; a store that cannot be read adds none."""
    clouds = remembered_clouds()
    if store is not None:
        try:
            for row in store.list_services():
                clouds |= {c for c in spec_from_json(row.spec_json).clouds()}
        except Exception as err:  # an unreadable row must not hide the remembered clouds
            log.warning("reading the services' clouds failed: %s", err)
    return sorted(clouds)


def live_machines(clouds: Iterable[str], provider: Callable[[str], Provider]) -> list[Instance]:
    """Every managed machine not terminated on those clouds (a cloud that cannot be read is
    logged and skipped)."""
    out: list[Instance] = []
    for cloud in clouds:
        try:
            listed = provider(cloud).list({TAG_MANAGED: "true"})
        except (ProviderError, UserError) as err:
            log.warning("%s: listing the managed machines failed: %s", cloud, err)
            continue
        out += [i for i in listed if i.status is not InstanceStatus.TERMINATED]
    return out


def open_store(url: str | None = None) -> Store:
    """The state store; StateLost (one line, how to recover) when its database cannot be read."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        store = Store(url)
        store.list_services()
        return store
    except SQLAlchemyError as err:
        reason = str(getattr(err, "orig", None) or err).splitlines()[0]
        raise StateLost(f"the state database {url or default_url()} cannot be read ({reason}); restore it from a "
                        "backup, or move it aside and terminate the machines it tracked with "
                        "`spotctl down --all --orphans`") from None


def check_state(store: Store, provider: Callable[[str], Provider]) -> None:
    """Raises StateLost when the store has no service while managed machines run on the clouds
    in use: a missing or emptied database must never start the daemon afresh beside them."""
    if store.list_services():
        return
    running = live_machines(clouds_in_use(None), provider)
    if running:
        services = sorted({i.service or "?" for i in running})
        raise StateLost(f"the state database {store.url} has no services but {len(running)} managed machine(s) "
                        f"of {', '.join(services)} still run; {RECOVER_HINT}")


class OrphanSweeper:
    """The daemon's sweep (see the module docstring). `sweep()` returns the orphans seen."""

    def __init__(self, store: Store, provider: Callable[[str], Provider], clock: Callable[[], float] = time.time):
        self.store = store
        self.provider = provider
        self.clock = clock
        self._first_seen: dict[str, float] = self._reported()

    def _reported(self) -> dict[str, float]:
        """Orphans reported before a restart keep their grace clock (it is in the events)."""
        seen: dict[str, float] = {}
        for ev in self.store.list_events(kinds=["orphan"], limit=1000):
            instance_id = json.loads(ev.data_json or "{}").get("instance_id")
            if instance_id:
                seen.setdefault(instance_id, ev.at)
        return seen

    @staticmethod
    def owner(inst: Instance, services: dict[str, ServiceRow]) -> str | None:
        """None when the machine belongs to a known service and incarnation, else why not
        (`services`: the stored ones by name, read once per sweep, not once per machine)."""
        row = services.get(inst.service or "")
        if row is None:
            return f"service {inst.service!r} is unknown"
        if row.incarnation and inst.incarnation and inst.incarnation != row.incarnation:
            return f"incarnation {inst.incarnation} of service {inst.service} is not the running one"
        return None

    def sweep(self, now_all: bool = False) -> list[dict]:
        """Report new orphans, terminate those past their grace (all of them with now_all)."""
        found = []
        now = self.clock()
        services = None
        for inst in live_machines(clouds_in_use(self.store), self.provider):
            if services is None:  # after the listing: a service stored meanwhile is known
                services = {row.name: row for row in self.store.list_services()}
            why = self.owner(inst, services)
            if why is None:
                continue
            first = self._first_seen.get(inst.instance_id)
            if first is None:
                first = self._first_seen[inst.instance_id] = now
                log.warning("orphan machine %s on %s (replica %s): %s; terminating it in %.0fs",
                            inst.instance_id, inst.location.cloud, inst.replica_id, why, grace_s())
                self.store.record_event("orphan", service=inst.service, replica_id=inst.replica_id,
                                        location=inst.location, market=inst.market, at=now,
                                        message=f"instance {inst.instance_id}: {why}",
                                        data={"instance_id": inst.instance_id})
            terminate = now_all or now - first >= grace_s()
            if terminate and inst.status is not InstanceStatus.STOPPING:
                self._terminate(inst, why)
            found.append({"instance_id": inst.instance_id, "cloud": inst.location.cloud, "service": inst.service,
                          "replica_id": inst.replica_id, "reason": why, "first_seen": first,
                          "terminating": terminate})
        return found

    def _terminate(self, inst: Instance, why: str) -> None:
        try:
            self.provider(inst.location.cloud).terminate(inst.instance_id)
        except ProviderError as err:
            log.warning("terminating orphan %s failed (will retry): %s", inst.instance_id, err)
            return
        log.warning("terminated orphan machine %s: %s", inst.instance_id, why)
        self.store.record_event("orphan_terminated", service=inst.service, replica_id=inst.replica_id,
                                location=inst.location, market=inst.market,
                                message=f"instance {inst.instance_id}: {why}")
