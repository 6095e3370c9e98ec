"""The daemon at scale: its memory, its reconcile pass and its idle CPU, from 100 to 1,000 services.

    .venv/bin/python tests/benchmarks/bench_daemon_scale.py [--sizes 100,300,1000] [--quiet-s 60]
    (BENCH_QUICK=1: 100 and 200 services, a 10 s quiet window)

Three processes per size: one health stand-in (tests/fakes/health_standin.py) that answers every
replica's readiness probe, the daemon (this script re-run with --serve-daemon: the real Daemon
and its API server, its provider the in-memory cloud of tests/fakes/memory_cloud.py, each
machine a path under the stand-in) and this one. N services of 4 READY replicas each are seeded
as a stopped daemon leaves them (store rows, running machines); the daemon adopts them on start,
and once every service and replica is READY and two passes ended, this one measures over a quiet
window (nothing launched, nothing failing, every probe answered):

- `rss_mb`: the daemon's resident memory (psutil) at the window's end;
- `pass_p50_s`, `pass_p99_s`: one reconcile pass over every service, from the daemon's own
  spot_daemon_pass_seconds histogram (the window's passes only; quantiles interpolated
  within buckets, as Prometheus does); `probe_pass_p50_s` beside it;
- `idle_cpu_cores`: the daemon's CPU time over the window / the window;
- `threads`: the daemon's thread count.

The load balancers run where `spotctl`'s daemon runs them: every service's in the one data-plane
process beside the daemon (orchestrator.lb.dataplane), not in the daemon. `dataplane_rss_mb`,
`dataplane_threads` and `dataplane_idle_cpu_cores` are that process's own figures at the same
moments, reported beside the daemon's (the goals are the daemon's).
Each size's keys go to stderr as it ends. Prints one JSON line: the largest size's keys,
`by_size` (every size's), `goals` and `goals_met` (at the largest size: rss under 300 MB, a
pass under 1 s at p99, under 0.25 core idle),
and `errors` (replicas that never became READY, probes the stand-in never saw: a failure count).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

REPLICAS = 4
GOALS = {"rss_mb": 300.0, "pass_p99_s": 1.0, "idle_cpu_cores": 0.25}
SPEC = """
name: {name}
service:
  readiness_probe: {{path: /health, initial_delay_seconds: 600}}
  replicas: {replicas}
resources: {{cloud: local, use_spot: true}}
engine: {{model: tiny}}
kv: {{enabled: false}}
"""
READY_TIMEOUT_S = 900.0


# ---- the daemon's side (this script re-run with --serve-daemon) ----------------------------

def serve_daemon(health_url: str, machines: str | None) -> None:
    """The daemon on the memory cloud, in the foreground; prints its URL and token once up.
    `machines`: the seeded fleet's instances (a JSON file), running before the daemon starts."""
    from orchestrator.control.daemon import Daemon, DaemonServer
    from orchestrator.control.dataplane import RemoteBalancers
    from orchestrator.control.store import Store
    from providers.base import Instance, InstanceStatus, Location, Market
    from tests.fakes.memory_cloud import MemoryCloud, MemoryLauncher

    clouds: dict[str, MemoryCloud] = {}
    seeded = json.loads(Path(machines).read_text()) if machines else []

    def provider(cloud: str) -> MemoryCloud:
        if cloud not in clouds:
            clouds[cloud] = MemoryCloud(cloud, health_url)
            clouds[cloud].restore(
                Instance(m["id"], Location(cloud, m["region"], m["zone"]), Market(m["market"]), m["type"],
                         InstanceStatus.RUNNING, tags=m["tags"], endpoint=m["endpoint"])
                for m in seeded if m["cloud"] == cloud)
        return clouds[cloud]

    daemon = Daemon(store=Store(), provider_factory=provider, launcher=MemoryLauncher(),
                    balancers=RemoteBalancers())  # as serve() runs it: the LBs in the data plane
    server = DaemonServer(daemon, "127.0.0.1", 0)
    server.start_in_thread()
    print(json.dumps({"url": daemon.url, "token": daemon.token}), flush=True)
    while True:
        time.sleep(3600)


# ---- the measuring side -------------------------------------------------------------------

def quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The q-quantile of the observations between two cumulative bucket snapshots, interpolated
    linearly within its bucket (Prometheus' histogram_quantile); None with no observation."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1]
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def pass_buckets(client, job: str) -> dict[float, float]:
    """spot_daemon_pass_seconds{job} cumulative bucket counts from the daemon's /metrics."""
    text = client.get("/metrics").text
    out: dict[float, float] = {}
    pattern = re.compile(r'^spot_daemon_pass_seconds_bucket\{job="%s",le="([^"]+)"\} (\S+)$' % job)
    for line in text.splitlines():
        m = pattern.match(line)
        if m:
            out[float(m.group(1))] = float(m.group(2))
    return out


class DaemonProcess:
    """A daemon process on the memory cloud (this script with --serve-daemon)."""

    def __init__(self, health_url: str, home: str, machines: str | None = None):
        import httpx

        env = {**os.environ, "SPOT_ORCHESTRATOR_HOME": home, "PYTHONPATH": str(REPO)}
        extra = ["--machines", machines] if machines else []
        self.home = Path(home)
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve-daemon", health_url, *extra],
                                     stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the daemon did not start (exit {self.proc.wait()})")
        info = json.loads(line)
        self.client = httpx.Client(base_url=info["url"], headers={"Authorization": f"Bearer {info['token']}"},
                                   timeout=300)

    def dataplane(self):
        """The data-plane process the daemon started (psutil), from its record."""
        return psutil.Process(json.loads((self.home / "dataplane.json").read_text())["pid"])

    def stop(self) -> None:
        """The daemon, then its data plane (which outlives a daemon by design)."""
        self.client.close()
        self.proc.kill()
        self.proc.wait()
        try:
            plane = self.dataplane()
            plane.kill()
            plane.wait(30)
        except (OSError, ValueError, KeyError, psutil.Error):  # no data plane started, or gone
            pass


def seed(home: str, services: int, health_url: str) -> str:
    """The state a stopped daemon left with `services` READY services of 4 READY replicas, in
    its store, and their machines (a JSON file for the memory cloud): the new daemon adopts them
    on start (restore_services), as after a restart. Bringing a thousand services up through
    the API instead takes most of an hour on two cores: every launch is a write, and a pass
    after a write reads row by row (orchestrator/control/snapshot.py). Returns the file's path."""
    from orchestrator.control.store import ServiceStatus, Store
    from orchestrator.fleet.lifecycle import ReplicaState as S
    from orchestrator.spec import load_spec_text
    from providers.base import LaunchRequest, Location, Market

    store = Store(f"sqlite:///{home}/state.db")
    machines, ports = [], lb_ports()
    for i in range(services):
        name, port = f"s{i:04d}", next(ports)
        spec = load_spec_text(SPEC.format(name=name, replicas=REPLICAS))
        with store.transaction() as tx:
            row = tx.create_or_update_service(name, spec.to_json(), status=ServiceStatus.READY,
                                              endpoint=f"http://127.0.0.1:{port}", lb_port=port)
            for k in range(REPLICAS):
                zone = "local-a" if k % 2 else "local-b"
                r = tx.add_replica(name, cloud="local", region="local-1", zone=zone, market="spot")
                r = tx.update_replica(r.replica_id, r.version, state=S.PROVISIONING.value, instance_type="mem.gpu",
                                      price_per_hour=0.4, reason="seeded")
                instance_id, now = f"m-{name}-{k}", time.time()
                endpoint = f"{health_url}/m/{instance_id}"
                r = tx.update_replica(r.replica_id, r.version, state=S.STARTING.value, instance_id=instance_id,
                                      endpoint=endpoint, launched_at=now, reason="seeded")
                tx.update_replica(r.replica_id, r.version, state=S.READY.value, ready_at=now, last_probe_ok_at=now,
                                  reason="seeded")
                tags = LaunchRequest(name, r.replica_id, Location("local", "local-1", zone), Market.SPOT, "mem.gpu",
                                     incarnation=row.incarnation).all_tags()
                machines.append({"id": instance_id, "cloud": "local", "region": "local-1", "zone": zone,
                                 "market": "spot", "type": "mem.gpu", "tags": tags, "endpoint": endpoint})
    store.close()
    path = Path(home) / "machines.json"
    path.write_text(json.dumps(machines))
    return str(path)


def lb_ports(start: int = 20000):
    """Free ports below the ephemeral range, for the seeded services' load balancers: a port
    free_port() finds there may be a probe connection's own local port by the time the daemon
    starts its load balancer on it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in range(start, low):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        yield port
    raise RuntimeError(f"no free port left below {low}")


def settled(client, services: int) -> int:
    """Waits until every replica is READY and two reconcile passes ended after that
    (the window must open on a quiet fleet). Returns how many replicas are not READY at the
    deadline (0 when all are)."""
    import httpx

    deadline = time.monotonic() + READY_TIMEOUT_S
    missing = services * REPLICAS
    while time.monotonic() < deadline:
        try:  # /metrics: the fleet by state in one read (/v1/services reads each service's replicas)
            ready = ready_replicas(client)
        except httpx.HTTPError:  # slow or failing while the adopting daemon's first passes hold the database
            time.sleep(2)
            continue
        missing = services * REPLICAS - ready
        if missing <= 0:
            passes = pass_count(client)  # two more: each service's status follows its replicas
            while pass_count(client) < passes + 2 and time.monotonic() < deadline:
                time.sleep(1)
            return 0
        time.sleep(2)
    return missing


def ready_replicas(client) -> int:
    text = client.get("/metrics").text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("spot_replicas{") and 'state="READY"' in line))


def pass_count(client) -> float:
    """Reconcile passes the daemon has finished."""
    return max(pass_buckets(client, "reconcile").values(), default=0.0)


def standin_count(health_url: str) -> int:
    import httpx

    return int(httpx.get(f"{health_url}/_count", timeout=10).text)


def measure(services: int, health_url: str, quiet_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as home:
        daemon = DaemonProcess(health_url, home, machines=seed(home, services, health_url))
        try:
            not_ready = settled(daemon.client, services)
            before = {job: pass_buckets(daemon.client, job) for job in ("reconcile", "probe")}
            probes_before = standin_count(health_url)
            ps, plane = psutil.Process(daemon.proc.pid), daemon.dataplane()
            cpu0, t0, plane_cpu0 = sum(ps.cpu_times()[:2]), time.monotonic(), sum(plane.cpu_times()[:2])
            time.sleep(quiet_s)
            cpu1, t1, plane_cpu1 = sum(ps.cpu_times()[:2]), time.monotonic(), sum(plane.cpu_times()[:2])
            rss_mb, threads = ps.memory_info().rss / 2**20, ps.num_threads()
            plane_rss_mb, plane_threads = plane.memory_info().rss / 2**20, plane.num_threads()
            probes = standin_count(health_url) - probes_before
            after = {job: pass_buckets(daemon.client, job) for job in ("reconcile", "probe")}
        finally:
            daemon.stop()

    def q(p: float, job: str) -> float | None:
        value = quantile(p, before[job], after[job])
        return None if value is None else round(value, 3)

    return {
        "services": services, "replicas": services * REPLICAS, "rss_mb": round(rss_mb, 1),
        "pass_p50_s": q(0.5, "reconcile"), "pass_p99_s": q(0.99, "reconcile"),
        "probe_pass_p50_s": q(0.5, "probe"), "idle_cpu_cores": round((cpu1 - cpu0) / (t1 - t0), 3),
        "threads": threads, "probes_per_s": round(probes / (t1 - t0), 1), "not_ready": not_ready,
        "dataplane_rss_mb": round(plane_rss_mb, 1), "dataplane_threads": plane_threads,
        "dataplane_idle_cpu_cores": round((plane_cpu1 - plane_cpu0) / (t1 - t0), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    quick = os.environ.get("BENCH_QUICK") == "1"
    parser.add_argument("--sizes", default="100,200" if quick else "100,300,1000")
    parser.add_argument("--quiet-s", type=float, default=10.0 if quick else 60.0)
    parser.add_argument("--serve-daemon", help=argparse.SUPPRESS)
    parser.add_argument("--machines", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_daemon:
        return serve_daemon(args.serve_daemon, args.machines)
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",")})
    except ValueError:
        sys.exit(f"error: --sizes {args.sizes!r}: a comma-separated list of service counts")
    if not sizes or sizes[0] <= 0:
        sys.exit(f"error: --sizes {args.sizes!r}: each count must be above 0")

    standin = subprocess.Popen([sys.executable, str(REPO / "tests" / "fakes" / "health_standin.py")],
                               stdout=subprocess.PIPE, text=True)
    try:
        health_url = f"http://127.0.0.1:{standin.stdout.readline().split()[1]}"
        by_size = []
        for n in sizes:
            by_size.append(measure(n, health_url, args.quiet_s))
            print(json.dumps(by_size[-1]), file=sys.stderr, flush=True)  # progress: a long run's sizes so far
    finally:
        standin.kill()
        standin.wait()
    top = by_size[-1]
    met = {key: top[key] is not None and top[key] < goal for key, goal in GOALS.items()}
    errors = sum(s["not_ready"] for s in by_size) + sum(1 for s in by_size if not s["probes_per_s"])
    print(json.dumps({
        **{k: top[k] for k in ("services", "rss_mb", "pass_p50_s", "pass_p99_s", "idle_cpu_cores",
                               "probe_pass_p50_s", "threads")},
        **{k: top[k] for k in ("dataplane_rss_mb", "dataplane_threads", "dataplane_idle_cpu_cores")},
        "by_size": by_size,
        "goals": GOALS,
        "goals_met": all(met.values()), "goals_missed": sorted(k for k, ok in met.items() if not ok),
        "quiet_s": args.quiet_s, "errors": errors,
    }))


if __name__ == "__main__":
    main()
