"""The daemon SIGKILLed at random moments: nothing leaks, doubles, sticks or reads as preempted.

    .venv/bin/python tests/benchmarks/bench_crash.py [--kills 50] [--seed 7]    (BENCH_QUICK=1: ~10 kills)

One service on the local cloud, its engine the stand-in vLLM (tests/fakes/upstream.py, through
SPOT_ORCHESTRATOR_LAUNCHER, so the daemons spotctl starts run it too). Operations cycle in a
seeded random order: `up`, scale (`up` with the other replica count), `spotctl chaos preempt`,
`down`, and `down` then `up` of the same service, each step through the real spotctl. During
each one the daemon is SIGKILLed once, at a seeded random moment; the next spotctl verb starts
it again (or `spotctl status` does), and the bench waits until the fleet converges. A few
operations first run without kills: the baseline the kills' convergence time is compared with.

Printed, one JSON line: `kills`; `leaked` (machines or processes nobody owns once converged:
a local-cloud instance that no live replica of the service records, a replica process whose
instance is gone, or a data-plane process still running after the last `down`, or beside the
recorded one); `duplicates` (two live machines tagged with one replica slot: service,
incarnation, replica id); `stuck` (a replica in a transient state over 5 minutes, or a fleet
that never converges); `false_preemptions` (replicas PREEMPTED whose machine no chaos notice
targeted); `lost_streams` (streams through the load balancer that failed); `streams`;
`converge_s_median` with kills, `baseline_converge_s_median` without, and their `ratio`.
The load balancers run in the data-plane process, which outlives the daemon: after each
convergence a few streams run while the daemon is SIGKILLed once more (`stream_kills`), and
every one of them must end whole.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers import alive as _alive  # noqa: E402 (the repository is on the path now)

SERVICE = "crash"
TRANSIENT = {"PENDING", "PROVISIONING", "STARTING", "SHUTTING_DOWN", "UNKNOWN", "DRAINING"}
TERMINAL = {"TERMINATED", "FAILED", "FAILED_INITIAL_DELAY", "FAILED_PROBING", "FAILED_PROVISION",
            "FAILED_CLEANUP", "PREEMPTED"}
STUCK_AFTER_S = 300.0
CONVERGE_TIMEOUT_S = 180.0
SPEC = """
name: {name}
service:
  readiness_probe: {{path: /health, initial_delay_seconds: 60}}
  replicas: {replicas}
resources: {{cloud: local, use_spot: true, any_of: [{{zone: local-a}}, {{zone: local-b}}]}}
engine: {{model: tiny}}
kv: {{enabled: false}}
"""


class Bench:
    def __init__(self, home: Path, seed: int):
        self.home = home
        self.rng = random.Random(seed)
        self.env = {
            **os.environ,
            "SPOT_ORCHESTRATOR_HOME": str(home),
            "SPOT_ORCHESTRATOR_DAEMON_PORT": str(_free_port()),
            "SPOT_ORCHESTRATOR_LAUNCHER": "tests.fakes.standin:StandInLauncher",
            "SPOT_ORCHESTRATOR_RECONCILE_S": "0.5",
            "SPOT_ORCHESTRATOR_PROBE_S": "0.5",
            "SPOT_ORCHESTRATOR_ORPHANS_S": "1",
            "SPOT_ORCHESTRATOR_ORPHAN_GRACE_S": "3",
            "PYTHONPATH": str(REPO),
        }
        self.replicas = 1
        self.up_wanted = False
        self.preempted_targets: set[str] = set()  # instance ids chaos warned
        self.preempted_seen: set[str] = set()
        self.transient_since: dict[tuple[str, str], float] = {}
        self.result = {"kills": 0, "leaked": 0, "duplicates": 0, "stuck": 0, "false_preemptions": 0,
                       "lost_streams": 0, "streams": 0, "stream_kills": 0}
        self.problems: list[str] = []

    # ---- the user's path --------------------------------------------------------------------

    def spotctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env=self.env, cwd=REPO)

    def step(self, *args: str, tries: int = 6, done_if: str = "") -> None:
        """A spotctl verb, again until it succeeds (a kill may cut it off mid-request); an
        error containing `done_if` means an earlier try got through."""
        err = ""
        for _ in range(tries):
            proc = self.spotctl(*args)
            err = proc.stderr.strip()
            if proc.returncode == 0 or (done_if and done_if in err):
                return
            time.sleep(0.5)
        self.problems.append(f"spotctl {' '.join(args)} kept failing: {err[-200:]}")

    def spec_file(self) -> str:
        path = self.home / "crash.yaml"
        path.write_text(SPEC.format(name=SERVICE, replicas=self.replicas))
        return str(path)

    def api(self, path: str, method: str = "GET"):
        import httpx

        try:
            info = json.loads((self.home / "daemon.json").read_text())
            token = (self.home / "token").read_text().strip()
            r = httpx.request(method, info["url"] + path, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        except (OSError, ValueError, httpx.HTTPError):
            return None
        return r.json() if r.status_code == 200 else ("missing" if r.status_code == 404 else None)

    def daemon_pid(self) -> int | None:
        try:
            return int(json.loads((self.home / "daemon.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None

    # ---- operations -----------------------------------------------------------------------

    def op_up(self) -> None:
        self.up_wanted = True
        self.step("up", self.spec_file())

    def op_scale(self) -> None:
        self.replicas = 2 if self.replicas == 1 else 1
        self.op_up()

    def op_preempt(self) -> None:
        svc = self.api(f"/v1/services/{SERVICE}")
        live = [r for r in svc["replicas"] if r["state"] == "READY"] if isinstance(svc, dict) else []
        if not live:
            return self.op_up()
        victim = self.rng.choice(live)
        self.preempted_targets.add(victim["instance_id"])
        self.step("chaos", "preempt", victim["replica_id"], "--grace", "2")

    def op_down(self) -> None:
        self.up_wanted = False
        self.step("down", SERVICE, "-y", "--no-wait", done_if="no service named")

    def op_down_up(self) -> None:
        self.up_wanted = False
        self.step("down", SERVICE, "-y", "--timeout", "60", done_if="no service named")
        self.op_up()

    def pick(self) -> callable:
        if not self.up_wanted:
            return self.op_up
        return self.rng.choice([self.op_scale, self.op_preempt, self.op_down, self.op_down_up, self.op_up])

    def run_op(self, kill: bool) -> float:
        """One operation, with a kill at a random moment of it when asked; the seconds until
        the fleet converged again."""
        op = self.pick()
        started = time.monotonic()
        killer = None
        if kill:
            delay = self.rng.uniform(0.0, 2.5)
            killer = threading.Thread(target=self.kill_after, args=(delay,), daemon=True)
            killer.start()
        op()
        if killer is not None:
            killer.join()
            self.spotctl("status")  # any verb starts the daemon again
        self.converge()
        return time.monotonic() - started

    def kill_after(self, delay: float) -> None:
        time.sleep(delay)
        pid = self.daemon_pid()
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
            self.result["kills"] += 1
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    # ---- convergence and what it found -------------------------------------------------------

    def machines(self) -> list[dict]:
        """The local cloud's live machines, from its records (what a user would `ps`)."""
        out = []
        for path in (self.home / "local-cloud" / "instances").glob("*.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if record["status"] != "terminated" and _alive(record["pid"]):
                out.append(record)
        return out

    def observe(self, svc) -> None:
        now = time.monotonic()
        rows = svc["replicas"] if isinstance(svc, dict) else []
        current = set()
        for r in rows:
            if r["state"] == "PREEMPTED" and r["instance_id"]:
                self.preempted_seen.add(r["instance_id"])
            if r["state"] in TRANSIENT:
                key = (r["replica_id"], r["instance_id"] or "")
                current.add(key)
                self.transient_since.setdefault(key, now)
        for key in list(self.transient_since):
            if key not in current:
                del self.transient_since[key]

    def converged(self, svc) -> bool:
        if svc is None:
            return False  # no daemon answering yet
        machines = self.machines()
        if not self.up_wanted:
            return svc == "missing" and not machines
        if not isinstance(svc, dict):
            return False
        rows = [r for r in svc["replicas"] if r["state"] not in TERMINAL]
        ready = [r for r in rows if r["state"] == "READY"]
        owned = {r["instance_id"] for r in rows if r["instance_id"]}
        return (len(ready) >= self.replicas and not any(r["state"] in TRANSIENT for r in rows)
                and {m["instance_id"] for m in machines} <= owned)

    def converge(self) -> None:
        deadline = time.monotonic() + CONVERGE_TIMEOUT_S
        while time.monotonic() < deadline:
            svc = self.api(f"/v1/services/{SERVICE}")
            pid = self.daemon_pid()
            if svc is None and (pid is None or not _alive(pid)):
                self.spotctl("status")  # (a kill after the last verb): any verb starts it
            self.observe(svc)
            self.count_duplicates()
            if self.converged(svc):
                return
            time.sleep(0.3)
        svc = self.api(f"/v1/services/{SERVICE}")
        owned = {r["instance_id"] for r in svc["replicas"] if r["state"] not in TERMINAL} \
            if isinstance(svc, dict) else set()
        leaked = [m["instance_id"] for m in self.machines() if m["instance_id"] not in owned]
        self.result["leaked"] += len(leaked)
        self.result["stuck"] += 1
        states = [(r["replica_id"], r["state"]) for r in svc["replicas"]] if isinstance(svc, dict) else svc
        self.problems.append(f"never converged (up={self.up_wanted}, replicas={self.replicas}): {states} "
                             f"leaked={leaked}")

    def count_duplicates(self) -> None:
        slots: dict[tuple, set[str]] = {}
        for m in self.machines():
            tags = m.get("tags", {})
            key = (tags.get("spot-orchestrator-service"), tags.get("spot-orchestrator-incarnation"),
                   tags.get("spot-orchestrator-replica"))
            slots.setdefault(key, set()).add(m["instance_id"])
        doubles = {k: v for k, v in slots.items() if len(v) > 1}
        for key, ids in doubles.items():
            marker = (key, frozenset(ids))
            if marker not in getattr(self, "_seen_doubles", set()):
                self._seen_doubles = getattr(self, "_seen_doubles", set()) | {marker}
                self.result["duplicates"] += 1
                self.problems.append(f"two machines for slot {key}: {sorted(ids)}")

    def streams(self, n: int = 3) -> None:
        """Streams through the LB with the daemon SIGKILLed while they run: the data plane
        serves them on; then the daemon is started again and the fleet converges."""
        svc = self.api(f"/v1/services/{SERVICE}")
        if not isinstance(svc, dict) or not svc.get("endpoint"):
            return
        threads = [threading.Thread(target=self.stream, args=(svc["endpoint"],)) for _ in range(n)]
        for t in threads:
            t.start()
        time.sleep(self.rng.uniform(0.2, 1.0))
        pid = self.daemon_pid()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
            self.result["stream_kills"] += 1
        for t in threads:
            t.join()
        self.spotctl("status")  # any verb starts the daemon again
        self.count_data_planes()
        self.converge()

    def stream(self, endpoint: str) -> None:
        import httpx

        self.result["streams"] += 1
        try:
            with httpx.stream("POST", endpoint + "/v1/completions", timeout=30,
                              json={"model": SERVICE, "prompt": "hi", "max_tokens": 40, "stream": True,
                                    "fake_token_delay": 0.05}) as r:
                body = "".join(r.iter_text())
            ok = r.status_code == 200 and "[DONE]" in body and '"error"' not in body
        except httpx.HTTPError as err:
            ok, body = False, repr(err)
        if not ok:
            self.result["lost_streams"] += 1
            self.problems.append(f"stream failed: {body[:160]}")

    def count_data_planes(self) -> None:
        """More than one data plane for this state directory: the others are nobody's."""
        extra = _data_planes(self.home)[1:]
        if extra:
            self.result["leaked"] += len(extra)
            self.problems.append(f"data planes beside the recorded one: {extra}")

    def finish(self) -> None:
        """Down everything and look for whatever outlived it."""
        self.up_wanted = False
        self.step("down", "--all", "-y", "--timeout", "120")
        self.converge()
        stray = _replica_processes(self.home)
        self.result["leaked"] += len(stray)
        if stray:
            self.problems.append(f"replica processes left: {stray}")
        pid = self.daemon_pid()
        if pid and _alive(pid):
            os.kill(pid, signal.SIGTERM)
        # No service left: the data plane exits on its own (after a 2 s grace).
        deadline = time.monotonic() + 15
        while _data_planes(self.home) and time.monotonic() < deadline:
            time.sleep(0.2)
        planes = _data_planes(self.home)
        self.result["leaked"] += len(planes)
        if planes:
            self.problems.append(f"data planes left after the last down: {planes}")
            for plane in planes:
                os.kill(plane, signal.SIGKILL)
        stuck = [k for k, since in self.transient_since.items() if time.monotonic() - since > STUCK_AFTER_S]
        self.result["stuck"] += len(stuck)
        false = self.preempted_seen - self.preempted_targets
        self.result["false_preemptions"] = len(false)
        if false:
            self.problems.append(f"preempted without a notice: {sorted(false)}")


def _replica_processes(home: Path) -> list[int]:
    """Live processes started as local-cloud machines of this home (they carry its instance env)."""
    found = []
    for process in psutil.process_iter(["environ"]):
        env = process.info["environ"] or {}  # None: not ours to read
        if env.get("SPOT_ORCHESTRATOR_HOME") == str(home) and "SPOT_ORCHESTRATOR_INSTANCE_ID" in env and \
                _alive(process.pid):
            found.append(process.pid)
    return found


def _data_planes(home: Path) -> list[int]:
    """The data-plane processes of this home (its `python -m orchestrator.lb.dataplane`), the
    recorded one first."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            env = Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"orchestrator.lb.dataplane" in cmdline and f"SPOT_ORCHESTRATOR_HOME={home}".encode() in env \
                and _alive(int(entry.name)):
            found.append(int(entry.name))
    try:
        recorded = int(json.loads((home / "dataplane.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        recorded = None
    return sorted(found, key=lambda pid: pid != recorded)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    quick = os.environ.get("BENCH_QUICK") == "1"
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=10 if quick else 50)
    parser.add_argument("--baseline-ops", type=int, default=3 if quick else 5)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--verbose", action="store_true", help="print what went wrong to stderr")
    opts = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-crash-"))
    bench = Bench(home, opts.seed)
    baseline, with_kills = [], []
    try:
        for _ in range(opts.baseline_ops):
            baseline.append(bench.run_op(kill=False))
            if bench.up_wanted:
                bench.streams()
        attempts = 0
        while bench.result["kills"] < opts.kills and attempts < opts.kills * 3:
            attempts += 1
            with_kills.append(bench.run_op(kill=True))
            if bench.up_wanted:
                bench.streams()
    finally:
        bench.finish()
        shutil.rmtree(home, ignore_errors=True)
    out = dict(bench.result)
    out["converge_s_median"] = round(statistics.median(with_kills), 2) if with_kills else None
    out["baseline_converge_s_median"] = round(statistics.median(baseline), 2) if baseline else None
    out["ratio"] = round(out["converge_s_median"] / out["baseline_converge_s_median"], 2) \
        if with_kills and baseline and out["baseline_converge_s_median"] else None
    out["seed"] = opts.seed
    if opts.verbose:
        for line in bench.problems:
            print(line, file=sys.stderr)
    out["problems"] = bench.problems[:5]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
