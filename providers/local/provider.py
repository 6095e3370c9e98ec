"""The `local` cloud: replicas are real local processes in simulated zones.

The providers' registry loads LocalProvider for `cloud: local` (the demo's, most tests'). One
region ("local") with zones of their own spot and on-demand prices. `launch()` runs the request's
command as a detached, niced process group with a scratch TMPDIR of its own, after substituting
{port}, {agent_port}, {control_port} and {instance_id}; each machine also learns its instance id
and where its notice file is. State is on disk under `paths.home()/local-cloud/`, behind a file
lock, so a restarted daemon or a CLI beside it sees the same cloud; a dead process reads as
TERMINATED. `inject_notice()` / `preempt_zone()` warn, then SIGKILL at the deadline;
`set_capacity()` caps a zone's market (CapacityError beyond it). docs/local-cloud.md has the
details, the reasons (why niced, why TMPDIR) and the API.
"""

from __future__ import annotations

import builtins
import dataclasses
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.common import paths, procs
from providers.base import (
    CapacityError,
    Instance,
    Instances,
    InstanceStatus,
    LaunchRequest,
    Location,
    MachineRuntime,
    Market,
    Notice,
    NoticeKind,
    Offer,
    Provider,
    ProviderError,
)
from providers.local import processes
from providers.local.records import Records
from providers.local.zones import (
    CLOUD,
    DEFAULT_ZONES,
    REGION,
    ZonePrices,
    default_root,
    normalize_zones,
    zones_from_json,
    zones_to_json,
)

# Passed to every replica process: where a notice for it appears (the local IMDS), its id.
NOTICE_FILE_ENV = "SPOT_ORCHESTRATOR_LOCAL_NOTICE_FILE"
INSTANCE_ID_ENV = "SPOT_ORCHESTRATOR_INSTANCE_ID"
TERMINATED_RETENTION_S = 3600.0  # like EC2, terminated instances stay listed for a while
_KILLING_NOTICES = (NoticeKind.PREEMPT, NoticeKind.MAINTENANCE)  # a rebalance only warns


class LocalProvider(Provider):
    """The `local` cloud (see the module docstring)."""

    name = CLOUD
    cheap_offers = True
    machines_on_this_host = True

    def __init__(
        self,
        root: Path | None = None,
        zones: Mapping[str, ZonePrices] | Sequence[str] | None = None,
        *,
        accelerator: str = "CPU",
        accelerator_count: int = 1,
        instance_type: str = "local-cpu",
        stop_timeout_s: float = 5.0,
        replica_python: Path | None = None,
    ):
        self.root = Path(root) if root is not None else default_root()
        self.replica_python = Path(replica_python or paths.replica_python())
        self.accelerator = accelerator
        self.accelerator_count = accelerator_count
        self.instance_type = instance_type
        self.stop_timeout_s = stop_timeout_s
        self._registry = Records(self.root)
        self._timers: dict[str, threading.Timer] = {}
        self._timers_lock = threading.Lock()
        self._closed = False
        with self._registry.locked():
            if zones is not None:
                self._registry.write_json("zones.json", zones_to_json(normalize_zones(zones)))
            elif self._registry.read_json("zones.json", None) is None:
                self._registry.write_json("zones.json", zones_to_json(DEFAULT_ZONES))
            pending = [r for r in self._registry.instances() if _pending_kill(r)]
        for record in pending:  # a restarted daemon still kills at the deadlines set before
            self._arm_timer(record["instance_id"], record["notice"]["deadline"])

    # ---- zones, prices, capacity ----------------------------------------------------

    def zones(self) -> dict[str, ZonePrices]:
        return zones_from_json(self._registry.read_json("zones.json", zones_to_json(DEFAULT_ZONES)))

    def locations(self, accelerator: str | None = None) -> builtins.list[Location]:
        return [Location(CLOUD, REGION, zone) for zone in self.zones()]

    def runtime(self) -> MachineRuntime:
        # The machines are processes of this host: the replica environment's interpreter,
        # loopback, vLLM's CPU build; notices come from this provider's own feed.
        return MachineRuntime(python=str(self.replica_python), bind_host="127.0.0.1", on_cpu=True,
                              on_this_host=True, notice_watcher=None)

    def set_price(self, zone: str, market: Market, price: float) -> None:
        """Change one zone's price of `market`; ProviderError for an unknown zone."""
        with self._registry.locked():
            zones = self._check_zone(zone)
            old = zones[zone]
            zones[zone] = dataclasses.replace(old, **{_price_field(Market(market)): float(price)})
            self._registry.write_json("zones.json", zones_to_json(zones))

    def set_capacity(self, zone: str, market: Market, n: int | None) -> None:
        """Cap running instances of `market` in `zone` at n (None: unlimited); ProviderError
        for an unknown zone."""
        with self._registry.locked():
            self._check_zone(zone)
            caps = self._registry.read_json("capacity.json", {})
            caps.setdefault(zone, {})[Market(market).value] = n
            self._registry.write_json("capacity.json", caps)

    def capacity(self, zone: str, market: Market) -> int | None:
        return self._registry.read_json("capacity.json", {}).get(zone, {}).get(Market(market).value)

    @classmethod
    def snapshot_offers(cls, accelerator: str | None = None, count: int | None = None) -> builtins.list[Offer]:
        # The zones as configured on disk: reading them starts nothing (no timers, no processes).
        zones = zones_from_json(Records(default_root()).read_json("zones.json", zones_to_json(DEFAULT_ZONES)))
        return [o for o in _zone_offers(zones, "CPU", 1, "local-cpu") if _matches(o, accelerator, count)]

    def offers(self, accelerator: str | None = None, count: int | None = None) -> builtins.list[Offer]:
        offers = _zone_offers(self.zones(), self.accelerator, self.accelerator_count, self.instance_type)
        return [o for o in offers if _matches(o, accelerator, count)]

    def _check_zone(self, zone: str) -> dict[str, ZonePrices]:
        zones = self.zones()
        if zone not in zones:
            raise ProviderError(f"the local cloud has no zone {zone!r}; zones: {', '.join(zones)}")
        return zones

    # ---- instances ----------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> Instance:
        """Start the request's machine (the same instance again for a client_token seen before).
        Raises CapacityError when the zone's market is at its cap, ProviderError for a location
        outside this cloud, an unknown zone, no command or a command that cannot run."""
        market = Market(request.market)
        loc = request.location
        with self._registry.locked():
            self._kill_interrupted_launches()
            for record in self._registry.instances():
                if record["client_token"] == request.client_token:
                    return self._observe(record)  # idempotent, like EC2's ClientToken
            if loc.cloud != CLOUD or loc.region != REGION:
                raise ProviderError(f"the local cloud cannot launch in {loc}: use {CLOUD}/{REGION}/<zone>")
            zones = self._check_zone(loc.zone)
            running = [
                r
                for r in self._registry.instances()
                if self._observe(r).status is not InstanceStatus.TERMINATED
            ]
            cap = self.capacity(loc.zone, market)
            in_zone = sum(1 for r in running if r["zone"] == loc.zone and r["market"] == market.value)
            if cap is not None and in_zone >= cap:
                raise CapacityError(
                    f"no {market.value} capacity in {loc} ({in_zone} running, capacity {cap})", loc, market
                )
            if not request.command:
                raise ProviderError(f"launch of {request.replica_id}: the request has no command to run")
            record = self._start(request, market, zones[loc.zone], {p for r in running for p in _ports(r)})
            self._registry.save(record)
            self._registry.end_launch(record["instance_id"])
            return self._instance(record, InstanceStatus.RUNNING)

    def _kill_interrupted_launches(self) -> None:
        """Kill the processes of launches whose launcher died before saving their record (call
        with the registry lock held): no record names them, so nothing else ever would."""
        for instance_id in self._registry.interrupted_launches():
            if self._registry.instance(instance_id) is None:
                for pid in processes.find_by_env(INSTANCE_ID_ENV, instance_id):
                    stat = procs.proc_stat(pid)
                    if stat is not None:
                        processes.signal_group(stat.pgid, signal.SIGKILL)
                shutil.rmtree(processes.scratch_dir(instance_id), ignore_errors=True)
            self._registry.end_launch(instance_id)

    def _start(
        self, request: LaunchRequest, market: Market, prices: ZonePrices, used: set[int]
    ) -> dict[str, Any]:
        instance_id = f"local-{secrets.token_hex(4)}"
        port = request.port or processes.free_port(used)
        agent_port = processes.free_port(used | {port})
        control_port = processes.free_port(used | {port, agent_port})
        values = {"port": str(port), "agent_port": str(agent_port), "control_port": str(control_port),
                  "instance_id": instance_id}
        notice_file = self._registry.notice_file(instance_id)
        self._registry.begin_launch(instance_id)
        scratch = processes.scratch_dir(instance_id)
        scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = {
            **os.environ,
            "TMPDIR": str(scratch),
            **{k: processes.substitute(str(v), values) for k, v in request.env.items()},
            NOTICE_FILE_ENV: str(notice_file),
            INSTANCE_ID_ENV: instance_id,
        }
        command = [processes.substitute(str(arg), values) for arg in request.command]
        log_path = paths.logs_dir() / f"{request.replica_id}.{instance_id}.log"
        with open(log_path, "ab") as log:
            try:
                proc = subprocess.Popen(
                    command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: terminate kills all of it
                    close_fds=True,
                )
            except OSError as err:
                shutil.rmtree(scratch, ignore_errors=True)
                self._registry.end_launch(instance_id)
                raise ProviderError(
                    f"launch of {request.replica_id}: cannot run {command[0]!r}: {err.strerror}"
                ) from None
        processes.track(proc)
        procs.lower_machine_priority(proc.pid)  # a machine of its own in a real cloud
        stat = procs.proc_stat(proc.pid)
        return {
            "instance_id": instance_id,
            "client_token": request.client_token,
            "cloud": CLOUD,
            "region": REGION,
            "zone": request.location.zone,
            "market": market.value,
            "instance_type": request.instance_type or self.instance_type,
            "tags": request.all_tags(),
            "pid": proc.pid,
            "pgid": proc.pid,
            "create_time": stat.create_time if stat else None,
            "port": port,
            "agent_port": agent_port,
            "control_port": control_port,
            "command": command,
            "log_path": str(log_path),
            "launched_at": time.time(),
            "price_per_hour": getattr(prices, _price_field(market)),
            "status": "running",
            "terminated_at": None,
            "reason": "",
            "notice": None,
        }

    def terminate(self, instance_id: str) -> None:
        """SIGTERM the machine's process group, SIGKILL what is left after stop_timeout_s
        (an unknown or terminated instance: nothing to do)."""
        with self._registry.locked():
            record = self._registry.instance(instance_id)
            if record is None or record["status"] == "terminated":
                return
            record["status"] = "stopping"
            self._registry.save(record)
        self._cancel_timer(instance_id)
        # Outside the lock: stopping may take stop_timeout_s and others must not wait for it.
        if processes.pid_alive(record["pid"], record.get("create_time")) or procs.group_members(record["pgid"]):
            processes.kill_group(record["pgid"], self.stop_timeout_s)
        with self._registry.locked():
            record = self._registry.instance(instance_id)
            if record is not None and record["status"] != "terminated":
                self._mark_terminated(record, "terminated")

    def get(self, instance_id: str) -> Instance | None:
        self._enforce_deadlines()
        with self._registry.locked():
            record = self._registry.instance(instance_id)
            return self._observe(record) if record is not None else None

    def list(self, tags: dict[str, str] | None = None, regions: Iterable[str] | None = None) -> Instances:
        self._enforce_deadlines()
        wanted = tags or {}
        now = time.time()
        out = []
        with self._registry.locked():
            self._kill_interrupted_launches()
            for record in self._registry.instances():
                if (
                    record["status"] == "terminated"
                    and now - (record["terminated_at"] or now) > TERMINATED_RETENTION_S
                ):
                    self._registry.remove(record["instance_id"])
                    continue
                if all(record["tags"].get(k) == v for k, v in wanted.items()):
                    out.append(self._observe(record))
        return Instances(out)

    def log_path(self, instance_id: str) -> Path:
        """Where the instance's output goes; ProviderError for an unknown instance."""
        record = self._registry.instance(instance_id)
        if record is None:
            raise ProviderError(f"no local instance {instance_id!r}")
        return Path(record["log_path"])

    def _observe(self, record: dict[str, Any]) -> Instance:
        """The instance as it is now; a process found dead is recorded as terminated.
        Call with the registry lock held."""
        if record["status"] != "terminated" and not processes.pid_alive(record["pid"], record.get("create_time")):
            # The "machine" is its leader process: when that exits, the instance is gone, and
            # so must be whatever it left behind in its group (e.g. vLLM's engine process).
            processes.signal_group(record["pgid"], signal.SIGKILL)
            processes.wait_group_gone(record["pgid"], 10.0)
            self._mark_terminated(record, "exited")
        status = {
            "running": InstanceStatus.RUNNING,
            "stopping": InstanceStatus.STOPPING,
            "terminated": InstanceStatus.TERMINATED,
        }[record["status"]]
        return self._instance(record, status)

    def _mark_terminated(self, record: dict[str, Any], reason: str) -> None:
        record.update(status="terminated", terminated_at=time.time(), reason=record["reason"] or reason)
        self._registry.save(record)
        # The machine's disk goes with it.
        shutil.rmtree(processes.scratch_dir(record["instance_id"]), ignore_errors=True)

    def _instance(self, record: dict[str, Any], status: InstanceStatus) -> Instance:
        return Instance(
            instance_id=record["instance_id"],
            location=Location(record["cloud"], record["region"], record["zone"]),
            market=Market(record["market"]),
            instance_type=record["instance_type"],
            status=status,
            tags=dict(record["tags"]),
            endpoint=f"http://127.0.0.1:{record['port']}",
            agent_endpoint=f"http://127.0.0.1:{record['agent_port']}",
            control_endpoint=f"http://127.0.0.1:{record['control_port']}" if record.get("control_port") else None,
            launched_at=record["launched_at"],
            price_per_hour=record["price_per_hour"],
        )

    # ---- preemptions ----------------------------------------------------------------

    def inject_notice(
        self, instance_id: str, grace_s: float, kind: NoticeKind = NoticeKind.PREEMPT
    ) -> Notice:
        """Warn the instance; a preempt (or maintenance) notice kills it at now + grace_s (a
        later notice never postpones an earlier kill). ProviderError unless it is running."""
        kind = NoticeKind(kind)
        now = time.time()
        deadline = now + max(0.0, float(grace_s))
        with self._registry.locked():
            record = self._registry.instance(instance_id)
            if record is None or self._observe(record).status is not InstanceStatus.RUNNING:
                raise ProviderError(f"no running local instance {instance_id!r}")
            if _pending_kill(record):  # a second notice never postpones the first one's kill
                deadline = min(deadline, record["notice"]["deadline"])
                if kind not in _KILLING_NOTICES:
                    kind = NoticeKind(record["notice"]["kind"])
            record["notice"] = {
                "kind": kind.value,
                "deadline": deadline,
                "received_at": now,
                "delivered": False,
            }
            self._registry.save(record)
            # What the replica's agent polls: the local stand-in for the cloud's metadata service.
            self._registry.write_path(
                self._registry.notice_file(instance_id),
                {"kind": kind.value, "action": "terminate", "deadline": deadline, "time": _rfc3339(deadline)},
            )
        if kind in _KILLING_NOTICES:
            self._arm_timer(instance_id, deadline)
        return Notice(instance_id=instance_id, kind=kind, deadline=deadline, source="local", received_at=now)

    def preempt_zone(self, zone: str, grace_s: float, market: Market = Market.SPOT) -> builtins.list[Notice]:
        """A correlated preemption: notices to every running `market` instance in `zone`.
        ProviderError for an unknown zone."""
        self._check_zone(zone)
        victims = [
            i.instance_id
            for i in self.list()
            if i.location.zone == zone and i.market is Market(market) and i.status is InstanceStatus.RUNNING
        ]
        return [self.inject_notice(instance_id, grace_s) for instance_id in victims]

    def notices(self) -> builtins.list[Notice]:
        """Notices not yet delivered to any LocalProvider (each is returned exactly once)."""
        self._enforce_deadlines()
        out = []
        with self._registry.locked():
            for record in self._registry.instances():
                notice = record.get("notice")
                if notice and not notice["delivered"]:
                    notice["delivered"] = True
                    self._registry.save(record)
                    out.append(
                        Notice(
                            instance_id=record["instance_id"],
                            kind=NoticeKind(notice["kind"]),
                            deadline=notice["deadline"],
                            source="local",
                            received_at=notice["received_at"],
                        )
                    )
        return out

    def _enforce_deadlines(self) -> None:
        """Kill instances whose notice deadline passed (also those no timer was armed for)."""
        now = time.time()
        due = [
            r["instance_id"]
            for r in self._registry.instances()
            if _pending_kill(r) and r["notice"]["deadline"] <= now
        ]
        for instance_id in due:
            self._kill_if_due(instance_id)

    def _kill_if_due(self, instance_id: str) -> None:
        with self._registry.locked():
            record = self._registry.instance(instance_id)
            if record is None or not _pending_kill(record) or record["notice"]["deadline"] > time.time():
                return
            # The cloud reclaims the machine: no SIGTERM, no grace beyond the notice.
            processes.signal_group(record["pgid"], signal.SIGKILL)
            processes.wait_group_gone(record["pgid"], 10.0)
            record["reason"] = "preempted"
            self._mark_terminated(record, "preempted")
        self._cancel_timer(instance_id)

    def _arm_timer(self, instance_id: str, deadline: float) -> None:
        with self._timers_lock:
            if self._closed:
                return
            old = self._timers.pop(instance_id, None)
            if old is not None:
                old.cancel()
            timer = threading.Timer(max(0.0, deadline - time.time()), self._kill_if_due, args=(instance_id,))
            timer.daemon = True
            timer.name = f"local-preempt-{instance_id}"
            self._timers[instance_id] = timer
            timer.start()

    def _cancel_timer(self, instance_id: str) -> None:
        with self._timers_lock:
            timer = self._timers.pop(instance_id, None)
        if timer is not None and timer is not threading.current_thread():
            timer.cancel()

    def close(self) -> None:
        """Stop this object's timers. Instances keep running (a restarted daemon finds them
        and re-arms their deadlines)."""
        with self._timers_lock:
            self._closed = True
            timers, self._timers = builtins.list(self._timers.values()), {}
        for timer in timers:
            timer.cancel()


def _zone_offers(zones: Mapping[str, ZonePrices], accelerator: str, count: int, instance_type: str) -> list[Offer]:
    now = time.time()
    return [
        Offer(Location(CLOUD, REGION, zone), instance_type, accelerator, count, market,
              getattr(prices, _price_field(market)), now, source="live")
        for zone, prices in zones.items()
        for market in (Market.SPOT, Market.ON_DEMAND)
    ]


def _matches(offer: Offer, accelerator: str | None, count: int | None) -> bool:
    return (accelerator is None or accelerator.lower() == offer.accelerator.lower()) and (
        count is None or count == offer.accelerator_count)


def _pending_kill(record: dict[str, Any]) -> bool:
    notice = record.get("notice")
    return (
        bool(notice) and record["status"] != "terminated" and NoticeKind(notice["kind"]) in _KILLING_NOTICES
    )


def _ports(record: dict[str, Any]) -> set[int]:
    return {record["port"], record["agent_port"], record.get("control_port", record["port"])}


def _price_field(market: Market) -> str:
    return "spot" if market is Market.SPOT else "on_demand"


def _rfc3339(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
