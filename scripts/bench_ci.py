"""Runs every benchmark in tests/benchmarks/ once, in a short mode, and fails (exit 1) when one
crashes, prints no JSON line, or reports a failure count above zero (client errors, token
mismatches, leaks, duplicates...). Ratios are printed, never judged: CI machines are noisy.

Called by `.ci/run` (through `make bench-ci`). A benchmark with no entry in QUICK runs with
BENCH_QUICK=1 only, which every benchmark is expected to honour for a shorter run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "tests" / "benchmarks"

# Per benchmark: (extra arguments, extra environment) for a run of a few minutes at most.
QUICK: dict[str, tuple[list[str], dict[str, str]]] = {
    "bench_codec.py": ([], {"BENCH_CODEC_MIB": "8", "BENCH_CODEC_REPEATS": "2"}),
    "bench_store.py": ([], {"BENCH_STORE_MIB": "128", "BENCH_STORE_ROUNDS": "1"}),
    "bench_market.py": ([], {"BENCH_MARKET_QUERIES": "200"}),
    "bench_lb.py": (["--requests", "300"], {}),
    "bench_hostile.py": (["--flood", "2000", "--flood-seconds", "10", "--probes", "50"], {}),
    "bench_migration.py": ([], {"BENCH_MIGRATION_PROMPT": "1024", "BENCH_MIGRATION_MAX_TOKENS": "160"}),
    "bench_policies.py": ([], {"BENCH_POLICIES": "spothedge"}),  # the pair compared, not every policy
}
# Keys that count failures: any value above zero (or a non-empty list) fails the run.
FAILURES = ("client_errors", "token_mismatches", "recompute_token_mismatches", "tracebacks", "server_errors",
            "cross_service_ok", "leaked", "duplicates", "stuck", "false_preemptions", "lost_streams", "errors")
TIMEOUT_S = int(os.environ.get("BENCH_CI_TIMEOUT_S", "1800"))


def failures(result: dict) -> list[str]:
    """The failure keys of one benchmark's JSON line that are not zero or empty."""
    bad = []
    for key in FAILURES:
        value = result.get(key)
        if isinstance(value, bool):
            value = int(value)
        if (isinstance(value, (int, float)) and value > 0) or (isinstance(value, (list, dict)) and value):
            bad.append(f"{key}={value}")
    if "error" in result:
        bad.append(f"error={result['error']}")
    return bad


def run(bench: Path) -> tuple[bool, str]:
    """Runs one benchmark; (passed, one-line summary)."""
    args, env = QUICK.get(bench.name, ([], {}))
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, str(bench), *args], cwd=REPO, capture_output=True, text=True,
                              timeout=TIMEOUT_S, env={**os.environ, "BENCH_QUICK": "1", **env})
    except subprocess.TimeoutExpired:
        return False, f"{bench.name}: timed out after {TIMEOUT_S} s"
    took = f"{time.monotonic() - started:.0f} s"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"{bench.name}: exit {proc.returncode} after {took}: {tail}"
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError as err:
        return False, f"{bench.name}: its last JSON line does not parse ({err})"
    bad = failures(result)
    verdict = "FAILED " + ", ".join(bad) if bad else "ok"
    return not bad, f"{bench.name}: {verdict} ({took}) {lines[-1]}"


def main() -> int:
    names = sys.argv[1:]
    benches = sorted(BENCHMARKS.glob("bench_*.py"))
    if names:
        benches = [b for b in benches if b.name in names or b.stem in names]
    passed = True
    for bench in benches:
        ok, line = run(bench)
        print(line, flush=True)
        passed &= ok
    print("benchmarks: all passed" if passed else "benchmarks: FAILED", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
