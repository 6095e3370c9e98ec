"""The long-running control plane: APScheduler jobs + the HTTP API, nothing else.

Each job calls one function of the library, so the daemon stays small:
    reconcile  every 2 s   Controller.reconcile() for each service
    probe      every 2 s   every service's replicas probed at once (Prober), Controller.apply_probes()
    prices     per cloud   pricebook.refresh_prices() (clouds whose quotes are cached)
    orphans    every 30 s  OrphanSweeper.sweep() (and once at start): machines nobody owns
All state is in the store; a restarted daemon rebuilds controllers and policies from it
(policies by replaying the events table) and adopts the load balancers, which `serve` keeps in
the data-plane process (orchestrator.control.dataplane) so that they outlive it. One daemon per
state directory: `serve` holds `daemon.lock` there (fcntl) for its lifetime, whatever its port, and refuses a
lost state database while managed machines run (orchestrator.control.orphans). Daemons on
other hosts sharing one PostgreSQL database: one leads (orchestrator.control.leader), the others
wait as standbys, their API answering only /v1/health (orchestrator.control.standby).

    python -m orchestrator.control.daemon [--host 127.0.0.1] [--port 8470]    (= `spotctl daemon`)
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import functools
import importlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import zlib
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import uvicorn
from apscheduler.executors.pool import ThreadPoolExecutor as APThreadPool
from apscheduler.schedulers.background import BackgroundScheduler


from orchestrator.control import auth, costing, discovery, kvtls, orphans, tls
from orchestrator.control.leader import Leadership, display_url
from orchestrator.control.standby import StandbyAPI

from orchestrator.common import logsetup, paths
from orchestrator.control.controller import Controller
from orchestrator.common.errors import UserError, exit_code_of
from orchestrator.control.balancers import Balancers, InProcessBalancers, ServiceBalancer
from orchestrator.control.pricebook import PriceBook, refresh_prices
from orchestrator.control.migration import Migrator
from orchestrator.control.prober import Prober
from orchestrator.control.snapshot import FleetSnapshot
from orchestrator.control.metrics import DaemonMetrics
from orchestrator.control.boot import BootScripts
from orchestrator.control.clouds import Clouds
from orchestrator.control.bootstrap import BootstrapTokens
from orchestrator.control.launch import VM_PORTS, ReplicaLauncher
from orchestrator.control.wheel import own_wheel
from orchestrator.spec import ServiceSpec, spec_from_json
from orchestrator.spec.revision import changed_launch_fields, launch_revision
from orchestrator.fleet import rollout
from orchestrator.control.store import ServiceStatus, Store, default_url
from policies.base import PlacementPolicy, UnknownPolicyError, load_policy
from providers import registry
from providers.base import Offers, Provider, ProviderError, ServiceNetwork

log = logging.getLogger("orchestrator.control.daemon")

RECONCILE_INTERVAL_S = float(os.environ.get("SPOT_ORCHESTRATOR_RECONCILE_S", "2"))
PROBE_INTERVAL_S = float(os.environ.get("SPOT_ORCHESTRATOR_PROBE_S", "2"))
# A steady service (every replica READY, nothing to do) whose rows nobody wrote since its last
# pass is reconciled every QUIET_EVERY-th pass only (10 s at the default 2 s): at a thousand
# services its passes were most of a quiet daemon's CPU. Any write (a probe's finding, a notice,
# a launch, an API call) makes the fleet's snapshot new, and every service is passed again.
# The probe job asks a steady service's replicas as seldom; meanwhile a replica that stops
# answering costs no client anything (the load balancer tries another), only a later probe.
QUIET_EVERY = int(os.environ.get("SPOT_ORCHESTRATOR_QUIET_EVERY", "5"))
PRICES_INTERVAL_S = float(os.environ.get("SPOT_ORCHESTRATOR_PRICES_S", "600"))
ORPHANS_INTERVAL_S = float(os.environ.get("SPOT_ORCHESTRATOR_ORPHANS_S", "30"))
# A ReplicaLauncher subclass ("module:Class") instead of the default: a custom replica runtime,
# or the tests' stand-in engine for daemons that spotctl starts.
LAUNCHER_ENV = "SPOT_ORCHESTRATOR_LAUNCHER"
# A reconcile or probe pass longer than this is logged once, with its time: every pass of the
# same job waits for it, and notices wait for the controller's lock it holds. (A cloud launch
# inside a reconcile takes seconds; five skipped 2 s intervals are worth a line.)
SLOW_PASS_S = 10.0
PUBLIC_URL_ENV = "SPOT_ORCHESTRATOR_PUBLIC_URL"


class _QuietSkips(logging.Filter):
    """apscheduler warns at every interval that a job still running was skipped (one line per
    2 s during a slow cloud launch); `_timed` says it once instead, with the time it took."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "maximum number of running instances" not in record.getMessage()


logging.getLogger("apscheduler.scheduler").addFilter(_QuietSkips())


def _timed(what: str, step: Callable[[], object]) -> None:
    started = time.monotonic()
    try:
        step()
    finally:
        took = time.monotonic() - started
        if took > SLOW_PASS_S:
            log.warning("%s took %.0fs; the passes due meanwhile were skipped", what, took)


class _PassTimer:
    """Counts a pass's services as their futures finish; reports the pass's time after the last."""

    def __init__(self, services: int, report: Callable[[float], None]):
        self._left, self._report = services, report
        self._started = time.monotonic()
        self._lock = threading.Lock()
        if not services:  # a pass over no service is done at once
            report(0.0)

    def __call__(self, _future) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._report(time.monotonic() - self._started)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(
        self,
        store: Store | None = None,
        host: str = "127.0.0.1",
        provider_factory: Callable[[str], Provider] = registry.make,
        launcher: ReplicaLauncher | None = None,
        policy_factory: Callable[[str], PlacementPolicy] = load_policy,
        public_url: str | None = None,
        balancers: Balancers | None = None,
    ):
        self.store = store or Store()
        # The URL replica VMs reach the daemon at; its own URL when unset (only the machines
        # of this host can use that one).
        self.public_url = (public_url or os.environ.get(PUBLIC_URL_ENV) or "").rstrip("/") or None
        self.bootstrap = BootstrapTokens(self.store)
        self.launcher = launcher or _launcher_from_env()
        self.policy_factory = policy_factory
        self.host = host
        self.url = ""
        self.token = auth.load_or_create_token()
        self._provider_factory = provider_factory
        self.providers: dict[str, Provider] = {}
        self.controllers: dict[str, Controller] = {}
        # Each service's load balancer: in this process (tests that build a Daemon), or in the
        # data-plane process that outlives the daemon (serve(): orchestrator.control.dataplane).
        self.balancers = balancers or InProcessBalancers()
        self._last_snapshot: FleetSnapshot | None = None
        self._quiet: dict[str, FleetSnapshot] = {}  # steady services: the snapshot they were steady in
        self._passes = {"reconcile": 0, "probe": 0}
        self.lbs: dict[str, ServiceBalancer] = {}
        self.metrics = DaemonMetrics(self.store, self.balancers.metrics_text)  # GET /metrics
        self.migrator = Migrator(self.store, self.controllers, self.lbs, self.provider, self.reconcile_service,
                                 registry=self.metrics.registry)
        self.book = PriceBook()  # live quotes of the real clouds in use (the local cloud prices itself)
        self.orphans = orphans.OrphanSweeper(self.store, self.provider)
        self.prober = Prober()  # every service's readiness probes, from one event loop
        self._lock = threading.RLock()
        self.started_at = time.time()
        self._reconcile_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="reconcile")
        self.scheduler = BackgroundScheduler(executors={"default": APThreadPool(8)}, job_defaults={"coalesce": True})

    # ---- services -----------------------------------------------------------------------

    def provider(self, cloud: str) -> Provider:
        with self._lock:
            if cloud not in self.providers:
                self.providers[cloud] = self._provider_factory(cloud)
            return self.providers[cloud]

    def spec_clouds(self, spec: ServiceSpec) -> list[str]:
        """The clouds a service runs on (the registry's default when its spec names none);
        raises UserError for an unknown cloud."""
        clouds = spec.clouds() or [registry.DEFAULT_CLOUD]
        for cloud in clouds:
            registry.check(cloud)
        return clouds

    def replica_url(self) -> str:
        return self.public_url or self.url

    def check_reachable(self, cloud: str) -> None:
        """Raises UserError when the cloud's machines could not reach the daemon: VMs need a
        URL that is not loopback, and a daemon bound to loopback has only that one."""
        if self.provider(cloud).runtime().on_this_host or self.public_url:
            return
        host = urllib.parse.urlsplit(self.url).hostname or self.host
        if host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", ""):
            raise UserError(f"resources.cloud {cloud}: its machines cannot reach the daemon at {self.url or host} "
                            f"(loopback); set {PUBLIC_URL_ENV} or run `spotctl daemon --public-url URL` with an "
                            "address the VMs can reach")

    def network_for(self, spec: ServiceSpec, cloud: str) -> ServiceNetwork:
        """What the service's replicas must be reachable on, and from where: the daemon (its
        replica URL's address) and, within the provider's rule, the service's own replicas."""
        host = urllib.parse.urlsplit(self.replica_url()).hostname or self.host
        try:
            address = socket.gethostbyname(host)
        except OSError as err:
            raise UserError(f"the daemon's URL {self.replica_url()}: cannot resolve {host}: {err}") from None
        regions = spec.regions(cloud) or sorted({loc.region for loc in self.provider(cloud).locations(None)})
        return ServiceNetwork(spec.name, tuple(VM_PORTS.values()), (f"{address}/32",), tuple(regions))

    def apply_spec(self, spec: ServiceSpec, update_mode: str = rollout.ROLLING) -> dict:
        """Create or update a service; returns its summary. Idempotent. An update whose launch
        fields changed replaces the replicas launched from the old ones (`update_mode`:
        orchestrator.fleet.rollout); any other change applies in place. Raises UserError for a
        spec the daemon cannot serve (unknown cloud or policy, unreachable daemon, network)."""
        if update_mode not in rollout.MODES:
            raise UserError(f"update mode {update_mode!r}: expected one of {', '.join(rollout.MODES)}")
        with self._lock:
            clouds = self.spec_clouds(spec)
            for cloud in clouds:
                self.check_reachable(cloud)
            try:
                self.policy_factory(spec.service.placement_policy)  # refuse before anything is stored
            except UnknownPolicyError as err:
                raise UserError(f"service.placement_policy: {err}") from None
            existing = self.store.get_service(spec.name)
            if existing is not None and existing.status == ServiceStatus.SHUTTING_DOWN:
                raise UserError(f"service {spec.name!r} is shutting down; wait for `spotctl down` to finish")
            port = (existing.lb_port if existing else None) or spec.service.ports or free_port(self.host)
            scheme = "https" if tls.service_tls(spec) else "http"  # missing or bad TLS files: refused here
            endpoint = f"{scheme}://{self.host}:{port}"
            for cloud in clouds:
                if self.provider(cloud).runtime().on_this_host:
                    continue
                own_wheel()  # what its VMs will install: built now (once), not inside a reconcile
                try:
                    self.provider(cloud).prepare_network(self.network_for(spec, cloud))
                except ProviderError as err:
                    raise UserError(f"resources.cloud {cloud}: setting up the service's network failed: {err}") \
                        from None
            orphans.remember_clouds(clouds)  # before any launch: a lost database still says where to look
            # A new spec gives a FAILED service a fresh start.
            fresh = ServiceStatus.PENDING if existing is not None and existing.status == ServiceStatus.FAILED else None
            if existing is not None:  # replicas of a daemon from before revisions ran the stored spec
                self.store.fill_spec_revision(spec.name, launch_revision(spec_from_json(existing.spec_json)))
            self.store.create_or_update_service(spec.name, spec.to_json(), status=fresh, endpoint=endpoint,
                                                lb_port=port)
            update = self._begin_update(spec, existing, update_mode) if existing is not None else None
            if spec.name in self.controllers:  # an update: new spec, same fleet
                self.controllers[spec.name].close()
                del self.controllers[spec.name]
            self._start_service(spec.name)
            self.store.record_event("service_up", service=spec.name, message=f"endpoint {endpoint}")
        threading.Thread(target=self.reconcile_service, args=(spec.name,), daemon=True).start()
        return {"name": spec.name, "endpoint": endpoint, "update": update}

    def _begin_update(self, spec: ServiceSpec, before, mode: str) -> dict:
        """Start replacing the live replicas of another launch revision (the controller's passes
        carry it out); what is replaced. Nothing to replace: the change applied in place."""
        revision = launch_revision(spec)
        old = [r for r in self.store.list_replicas(spec.name) if r.spec_revision != revision]
        if not old:
            return {"mode": None, "revision": revision, "replacing": 0}
        if before.update_mode == mode and launch_revision(spec_from_json(before.spec_json)) == revision:
            return {"mode": mode, "revision": revision, "replacing": len(old)}  # the same update, again
        changed = changed_launch_fields(spec_from_json(before.spec_json), spec)
        self.store.update_service(spec.name, update_mode=mode)
        self.store.record_event(
            "update_started", service=spec.name,
            message=f"{mode} update to revision {revision}: {len(old)} replica(s) to replace"
                    + (f" ({', '.join(changed)} changed)" if changed else ""),
            data={"mode": mode, "revision": revision, "replacing": [r.replica_id for r in old], "changed": changed})
        return {"mode": mode, "revision": revision, "replacing": len(old)}

    def _start_service(self, name: str) -> None:
        row = self.store.get_service(name)
        spec = spec_from_json(row.spec_json)
        clouds = self.spec_clouds(spec)
        cert = tls.service_tls(spec)
        lb = self.balancers.open(name, self.host, row.lb_port, (cert.certfile, cert.keyfile) if cert else None,
                                 spec.service.load_balancing_policy)
        self.lbs[name] = lb
        controller = Controller(
            name,
            self.store,
            Clouds({cloud: self.provider(cloud) for cloud in clouds}),
            self.launcher or ReplicaLauncher(
                daemon_url=self.replica_url() or None,
                boot=BootScripts.for_daemon(self.replica_url(), self.bootstrap) if self.replica_url() else None,
            ),
            offers=self._offers_of(spec, clouds),
            policy=self.policy_factory(spec.service.placement_policy),
            on_upstreams=lb.set_replicas,
            on_notice=self.migrator.on_notice,
            on_retire=self.migrator.retire,
            counters=self.metrics.counters,
            prober=self.prober,
        )
        self.controllers[name] = controller
        controller.publish_upstreams()

    def _offers_of(self, spec: ServiceSpec, clouds: list[str]) -> Callable[[], Offers]:
        """Every cloud's quotes for the service: asked of the provider itself when that is cheap
        (the local cloud), else from the price book."""
        sources = [self.provider(c).offers if self.provider(c).cheap_offers else self._book_offers(spec, c)
                   for c in clouds]
        return lambda: Offers(o for source in sources for o in source())

    def _book_offers(self, spec: ServiceSpec, cloud: str) -> Callable[[], Offers]:
        """A real cloud's quotes come from the price book the prices job keeps fresh (asking
        the cloud's price API on every 2 s reconcile would be slow and throttled)."""
        wanted = [(a.name, a.count) for alt in (spec.resources, *spec.resources.any_of) for a in alt.accelerators]
        wanted = list(dict.fromkeys(wanted)) or [(None, None)]

        def quotes() -> Offers:
            return Offers(o for name, count in wanted for o in self.book.offers(name, count, clouds=[cloud]))

        def offers() -> Offers:
            found = quotes()
            if not found:  # no refresh yet: the provider itself, once, to seed the book
                for name, count in wanted:
                    self.book.update(self.provider(cloud).offers(name, count))
                found = quotes()
            return found

        return offers

    def refresh_prices(self) -> int:
        clouds = {name: p for name, p in list(self.providers.items()) if not p.cheap_offers}
        return refresh_prices(clouds, self.book, self.store) if clouds else 0

    def restore_services(self) -> None:
        """After a restart: a controller and a load balancer for every stored service (the
        data plane's running LBs adopted as they are; those of services gone are stopped)."""
        rows = self.store.list_services()
        try:
            self.balancers.adopt(row.name for row in rows)
        except Exception as err:  # opening each service's LB below starts a data plane again
            log.error("the running load balancers could not be adopted: %s", err)
        for row in rows:
            try:
                self._start_service(row.name)
            except Exception as err:  # one broken service must not keep the others down
                log.error("service %s could not be restored: %s", row.name, err)

    def down(self, name: str) -> None:
        with self._lock:
            if self.store.get_service(name) is None:
                raise UserError(f"no service named {name!r}")
            self.store.update_service(name, status=ServiceStatus.SHUTTING_DOWN)
            self.store.record_event("service_down", service=name, message="shutting down")
        threading.Thread(target=self.reconcile_service, args=(name,), daemon=True).start()

    def _finish_down(self, name: str) -> None:
        controller = self.controllers.get(name)
        if controller is not None and not controller.finished_shutting_down():
            return
        with self._lock:
            if controller is not None:
                controller.close()
            self.controllers.pop(name, None)
            lb = self.lbs.pop(name, None)
            final = self._final_cost(name, lb)  # before the LB (and its token count) goes
            self.balancers.stop(name)
            self._remove_network(name)
            self.store.delete_bootstrap_tokens(name)
            kvtls.forget_service(name)
            self.store.delete_service(name)
            message = "all replicas terminated" + (f"; {costing.summary(final)}" if final else "")
            self.store.record_event("service_deleted", service=name, data={"cost": final} if final else None,
                                    message=message)

    def cost(self, name: str, lb: ServiceBalancer | None = None) -> costing.CostReport:
        """What the service has cost (GET /v1/cost): its replica rows, terminal ones included,
        priced by what was recorded at launch, else by its offers now; its LB's token count."""
        row = self.store.get_service(name)
        if row is None:
            raise UserError(f"no service named {name!r}")
        spec = spec_from_json(row.spec_json)
        try:
            offers = self._offers_of(spec, self.spec_clouds(spec))()
        except (ProviderError, UserError) as err:  # a cloud's quotes unreachable: recorded prices still count
            log.warning("cost of %s: no current quotes: %s", name, err)
            offers = Offers()
        replicas = costing.billed_replicas(self.store.list_replicas(name, include_terminal=True),
                                           self.store.list_events(service=name, kinds=["transition"]))
        lb = lb or self.lbs.get(name)
        tokens = None
        if lb is not None:
            try:
                tokens = costing.TokenCount(*lb.output_tokens())
            except Exception as err:  # the data plane away for a moment: the cost without $/M tokens
                log.warning("cost of %s: no token count from its load balancer: %s", name, err)
        return costing.service_cost(name, replicas, costing.quote_lookup(offers), time.time(), tokens)

    def _final_cost(self, name: str, lb: ServiceBalancer | None) -> dict | None:
        """The cost report kept in the service_deleted event: the replica rows go with the
        service. None (logged) when it cannot be made: that must not keep `down` from ending."""
        try:
            return self.cost(name, lb).as_dict()
        except Exception:
            log.exception("service %s: its final cost could not be computed", name)
            return None

    def _remove_network(self, name: str) -> None:
        row = self.store.get_service(name)
        if row is None:
            return
        spec = spec_from_json(row.spec_json)
        for cloud in self.spec_clouds(spec):
            try:
                if not self.provider(cloud).runtime().on_this_host:
                    self.provider(cloud).remove_network(name, self.network_for(spec, cloud).regions)
            except (ProviderError, UserError) as err:
                log.warning("service %s: removing its network on %s failed (remove it by hand): %s", name, cloud,
                            err)

    # ---- jobs -------------------------------------------------------------------------

    def reconcile_service(self, name: str, snapshot: FleetSnapshot | None = None) -> None:
        controller = self.controllers.get(name)
        try:
            if controller is None:  # a service whose controller could not start: only `down` works
                row = self.store.get_service(name)
                if row is not None and row.status == ServiceStatus.SHUTTING_DOWN:
                    self._finish_down(name)
                return
            reads = snapshot.reads(name) if snapshot else None
            _timed(f"reconcile of {name}", lambda: controller.reconcile(reads))
            # From the snapshot while nothing was written (most passes): one query per service
            # per pass was half a quiet daemon's CPU at 200 services.
            row = (reads or self.store).get_service(name)
            if row is not None and row.status == ServiceStatus.SHUTTING_DOWN:
                self._finish_down(name)
            elif snapshot is not None and snapshot.fresh() and controller.steady(reads):
                self._quiet[name] = snapshot
            else:
                self._quiet.pop(name, None)
        except Exception:
            log.exception("reconcile of %s failed", name)

    def _skips(self, job: str, name: str, snapshot: FleetSnapshot) -> bool:
        """Whether this pass of `job` leaves the service out: it is steady, nothing was written
        since, and this is not its turn. Turns are staggered by name, so each pass takes a
        QUIET_EVERY-th of the steady services, not all of them every QUIET_EVERY-th pass."""
        if self._quiet.get(name) is not snapshot:
            return False
        return (self._passes[job] + zlib.crc32(name.encode())) % QUIET_EVERY != 0

    def _snapshot(self) -> FleetSnapshot:
        """The fleet's rows in two queries, not a dozen per service; the last one again while
        nothing was written since (a quiet fleet's reconcile and probe passes share it)."""
        last = self._last_snapshot
        if last is None or not last.fresh():
            last = self._last_snapshot = FleetSnapshot(self.store)
        return last

    def reconcile_all(self) -> None:
        """Each service's pass in its own thread: one slow cloud launch holds up only its own
        service (whose next pass is skipped while it runs), never the others. The pass's time,
        until the last service's is done, goes to spot_daemon_pass_seconds{job="reconcile"}."""
        names = list(self.controllers)
        self._passes["reconcile"] += 1
        done = _PassTimer(len(names), self.metrics.passes.labels("reconcile").observe)
        snapshot = self._snapshot()
        for name in names:
            if self._skips("reconcile", name, snapshot):
                done(None)
            else:
                self._reconcile_pool.submit(self.reconcile_service, name, snapshot).add_done_callback(done)

    def probe_all(self) -> None:
        """Every service's replicas probed together (one Prober.check), then each service's
        outcomes applied; the pass's time goes to spot_daemon_pass_seconds{job="probe"}."""
        try:
            self.balancers.check()  # a data plane that died is started again and re-fed
        except Exception:
            log.exception("the data plane check failed")
        started = time.monotonic()
        snapshot = self._snapshot()
        self._passes["probe"] += 1
        rounds = []
        for name, controller in list(self.controllers.items()):
            if self._skips("probe", name, snapshot):
                continue  # steady and unchanged: its READY replicas are asked every QUIET_EVERY-th pass
            try:
                rounds.append((name, controller, controller.probe_targets(snapshot.reads(name))))
            except Exception:
                log.exception("probe of %s failed", name)
        oks = iter(self.prober.check([target for *_, targets in rounds for _, target in targets]))
        for name, controller, targets in rounds:
            results = [(r, next(oks)) for r, _ in targets]
            try:
                _timed(f"probe of {name}", functools.partial(controller.apply_probes, results, snapshot.reads(name)))
            except Exception:
                log.exception("probe of %s failed", name)
        self.metrics.passes.labels("probe").observe(time.monotonic() - started)

    def sweep_orphans(self, now_all: bool = False) -> list[dict]:
        try:
            return self.orphans.sweep(now_all)
        except Exception:
            log.exception("the orphan sweep failed")
            return []

    def start_jobs(self) -> None:
        self.scheduler.add_job(self.reconcile_all, "interval", seconds=RECONCILE_INTERVAL_S, id="reconcile",
                               max_instances=1)
        self.scheduler.add_job(self.probe_all, "interval", seconds=PROBE_INTERVAL_S, id="probe", max_instances=1)
        self.scheduler.add_job(self.refresh_prices, "interval", seconds=PRICES_INTERVAL_S, id="prices",
                               max_instances=1)
        self.scheduler.add_job(self.sweep_orphans, "interval", seconds=ORPHANS_INTERVAL_S, id="orphans",
                               max_instances=1, next_run_time=datetime.datetime.now())
        self.scheduler.start()

    def shutdown(self) -> None:
        """Stop jobs and in-process load balancers; replicas and a data plane keep running (a
        restart adopts them)."""
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        self.balancers.shutdown()
        for controller in self.controllers.values():
            controller.close()
        self._reconcile_pool.shutdown(wait=False, cancel_futures=True)
        for provider in self.providers.values():
            provider.close()
        self.prober.close()


class DaemonServer:
    """The daemon's API server plus its jobs; `run()` in the foreground, or a thread (tests)."""

    def __init__(self, daemon: Daemon, host: str = "127.0.0.1", port: int = 0, cert: tls.CertPair | None = None):
        from orchestrator.control.api import create_app
        from orchestrator.control.gate import server_config

        self.daemon = daemon
        self.cert = cert
        port = port or free_port(host)
        daemon.url = f"{'https' if cert else 'http'}://{host}:{port}"
        config = server_config(create_app(daemon), host, port)
        if cert is not None:
            config.ssl_certfile, config.ssl_keyfile = cert.certfile, cert.keyfile
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def _on_started(self) -> None:
        while not self.server.started:
            if self.server.should_exit:
                return
            time.sleep(0.05)
        discovery.write_daemon_info(self.daemon.url, self.cert.certfile if self.cert else None)
        self.daemon.restore_services()
        self.daemon.start_jobs()
        log.info("daemon listening on %s (state in %s)", self.daemon.url, paths.home())

    def run(self) -> None:
        threading.Thread(target=self._on_started, daemon=True).start()
        try:
            self.server.run()
        finally:
            self._cleanup()

    def start_in_thread(self, timeout: float = 30.0) -> None:
        self._thread = threading.Thread(target=self.server.run, daemon=True)
        self._thread.start()
        self._on_started()
        if not self.server.started:
            raise RuntimeError("daemon API did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._cleanup()

    def _cleanup(self) -> None:
        self.daemon.shutdown()
        info = discovery.read_daemon_info()
        if info and info.get("pid") == os.getpid():
            discovery.daemon_info_path().unlink(missing_ok=True)


def _launcher_from_env() -> ReplicaLauncher | None:
    target = os.environ.get(LAUNCHER_ENV)
    if not target:
        return None
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)()
    except (ImportError, AttributeError, ValueError) as err:
        raise UserError(f"{LAUNCHER_ENV}={target}: cannot load it ({err})") from None


def hold_state_lock():
    """The state directory's daemon lock (an open file; held until the process ends).
    Raises UserError when another daemon holds it."""
    path = discovery.daemon_lock_path()
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        fh.close()
        raise UserError(f"a daemon (pid {holder}) already runs for the state in {paths.home()}") from None
    fh.truncate(0)
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


def lead(host: str, port: int, cert: tls.CertPair | None) -> Leadership:
    """Wait until this daemon leads its state database (at once on SQLite, or when no other
    daemon leads it); meanwhile a standby's API answers on the port. Returns the held lock."""
    from sqlalchemy.exc import SQLAlchemyError

    url = default_url()
    leadership = Leadership(url)
    standby: list[StandbyAPI] = []

    def on_wait() -> None:
        log.info("standby: another daemon leads %s; waiting", display_url(url))
        standby.append(StandbyAPI(host, port, cert))
        standby[0].start()

    try:
        leadership.wait(on_wait=on_wait)
    except SQLAlchemyError as err:
        reason = str(getattr(err, "orig", None) or err).splitlines()[0]
        raise orphans.StateLost(f"the state database {display_url(url)} cannot be reached ({reason})") from None
    finally:
        for api in standby:
            api.stop()
    if standby:
        log.info("leading %s now: taking over its services", display_url(url))
    return leadership


def serve(host: str = "127.0.0.1", port: int = discovery.DEFAULT_PORT, public_url: str | None = None,
          certfile: str | None = None, keyfile: str | None = None, plain_http: bool = False) -> None:
    cert = tls.api_tls(host, certfile, keyfile, plain_http)  # before anything starts
    logsetup.configure_daemon()  # level: SPOT_ORCHESTRATOR_LOG_LEVEL (`spotctl --log-level`)
    lock = hold_state_lock()  # noqa: F841 - held for the life of the process
    # Nothing below (state check, restore, orphan sweep, jobs) may run before this daemon leads.
    leadership = lead(host, port, cert)  # noqa: F841 - held for the life of the process
    store = orphans.open_store()
    from orchestrator.control.dataplane import RemoteBalancers

    daemon = Daemon(store=store, host=host, public_url=public_url, balancers=RemoteBalancers())
    orphans.check_state(store, daemon.provider)
    server = DaemonServer(daemon, host, port, cert)
    signal.signal(signal.SIGTERM, lambda *_: setattr(server.server, "should_exit", True))
    server.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spotctl daemon")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=discovery.DEFAULT_PORT)
    parser.add_argument("--public-url", help=f"the URL replica VMs reach the daemon at (or ${PUBLIC_URL_ENV})")
    parser.add_argument("--tls-certfile", help=f"the API's certificate (or ${tls.CERTFILE_ENV})")
    parser.add_argument("--tls-keyfile", help=f"its key (or ${tls.KEYFILE_ENV})")
    parser.add_argument("--plain-http", action="store_true", help="beyond loopback without TLS (a TLS proxy)")
    opts = parser.parse_args(argv)
    return exit_code_of(lambda: serve(opts.host, opts.port, opts.public_url, opts.tls_certfile, opts.tls_keyfile,
                                      opts.plain_http))


if __name__ == "__main__":
    sys.exit(main())
