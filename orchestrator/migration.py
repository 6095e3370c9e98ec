"""notice -> drain -> flush KV -> resume in-flight requests elsewhere (the preemption path).

Steps 1-3 of DESIGN.md's preemption path, in the order that keeps clients unaware:
1. the controller marks the replica DRAINING (the load balancer stops sending it new
   requests the same instant) and the policy is asked for a replacement at once, not at
   the next tick: a notice is the cheapest moment to start a cold start;
2. the replica's connector pushes its not yet coded KV blocks to the shard stores (flush);
3. the load balancer cuts the replica's in-flight streams and continues each on a healthy
   replica from the tokens already streamed; that replica loads the prefix from shards.
At the deadline the instance dies; the controller observes it and marks it PREEMPTED.
"""

from __future__ import annotations

import logging
import threading
import time

import httpx

from orchestrator.errors import UserError
from orchestrator.replica import ReplicaState, is_alive
from orchestrator.state import ReplicaRow
from providers.base import Notice, NoticeKind

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 10.0


class Migrator:
    def __init__(self, daemon):  # orchestrator.daemon.Daemon
        self.daemon = daemon
        self._http = httpx.Client(timeout=FLUSH_TIMEOUT_S)

    def _controller_for_instance(self, instance_id: str):
        for name, controller in list(self.daemon.controllers.items()):
            for r in self.daemon.store.list_replicas(name):
                if r.instance_id == instance_id:
                    return controller
        return None

    def on_notice(self, notice: Notice) -> str | None:
        """Handle one notice (from an agent, a cloud feed or chaos); the replica id or None."""
        controller = self._controller_for_instance(notice.instance_id)
        if controller is None:
            return None
        already = controller._replica_for_instance(notice.instance_id)
        was_draining = already is not None and already.replica_state is ReplicaState.DRAINING
        replica = controller.handle_notice(notice)
        if replica is None or was_draining:
            return replica.replica_id if replica else None
        log.info("notice for %s (deadline in %.1fs): draining", replica.replica_id, notice.deadline - time.time())
        # The replacement: reconcile now, in the background, so the notice returns at once.
        threading.Thread(target=self.daemon.reconcile_service, args=(replica.service,), daemon=True).start()
        threading.Thread(target=self._migrate, args=(replica, notice), daemon=True).start()
        return replica.replica_id

    def _migrate(self, replica: ReplicaRow, notice: Notice) -> None:
        lb = self.daemon.lbs.get(replica.service)
        if lb is None:
            return
        in_time = notice.deadline > time.time()
        before_cut = (lambda: self.flush(replica)) if in_time else None
        try:
            lb.migrate(replica.replica_id, before_cut=before_cut)
        except Exception:
            log.exception("migrating the requests of %s failed", replica.replica_id)

    def flush(self, replica: ReplicaRow) -> bool:
        """Ask the replica to push its not yet coded KV blocks; True when it confirmed."""
        if not replica.control_endpoint:
            return False
        try:
            r = self._http.post(f"{replica.control_endpoint}/v1/flush", headers=self._kv_auth(replica.service))
            return r.status_code == 200
        except httpx.HTTPError as err:
            log.warning("flush of %s failed: %s (continuations will recompute)", replica.replica_id, err)
            return False

    def _kv_auth(self, service: str) -> dict[str, str]:
        from orchestrator.replica_command import kv_secret_file

        return {"Authorization": f"Bearer {kv_secret_file(service).read_text().strip()}"}

    # ---- chaos ---------------------------------------------------------------------------

    def chaos_preempt(self, replica_id: str | None, zone: str | None, grace_s: float, service: str | None) -> list[str]:
        targets = self._chaos_targets(replica_id, zone, service)
        done = []
        for r in targets:
            provider = self.daemon.provider(r.cloud)
            inject = getattr(provider, "inject_notice", None)
            if inject is not None:
                notice = inject(r.instance_id, grace_s)
            else:  # a real cloud: our own notice, and we end the instance at its deadline
                notice = Notice(r.instance_id, NoticeKind.PREEMPT, time.time() + grace_s, source="chaos")
                threading.Timer(grace_s, provider.terminate, args=(r.instance_id,)).start()
            self.daemon.store.record_event(
                "chaos", service=r.service, replica_id=r.replica_id, location=r.location, market=r.market_enum,
                message=f"preemption injected, grace {grace_s:.0f}s",
            )
            self.on_notice(Notice(notice.instance_id, notice.kind, notice.deadline, source="chaos"))
            done.append(r.replica_id)
        return done

    def _chaos_targets(self, replica_id: str | None, zone: str | None, service: str | None) -> list[ReplicaRow]:
        replicas = [
            r
            for name in ([service] if service else list(self.daemon.controllers))
            for r in self.daemon.store.list_replicas(name)
            if is_alive(r.replica_state) and r.instance_id
        ]
        if replica_id:
            found = [r for r in replicas if r.replica_id == replica_id]
            if not found:
                raise UserError(f"no live replica named {replica_id!r} (see `spotctl status`)")
            return found
        found = [r for r in replicas if r.zone == zone]
        if not found:
            raise UserError(f"no live replica in zone {zone!r}")
        return found
