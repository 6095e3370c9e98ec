"""`spotctl up --wait`: per-replica progress (replica, zone, market, state, elapsed) until the
service has a READY replica; fails at once when the service FAILED. `spotctl update --wait`: the
same until its update finished. A terminal gets a live rich table; a pipe gets one line per
replica state change. Called by cli/service.py."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from rich.console import Console
from rich.live import Live
from rich.table import Table

from orchestrator.cli.client import DaemonClient
from orchestrator.common.errors import RuntimeFailure

POLL_S = 1.0


def _elapsed(replica: dict, now: float) -> str:
    secs = int(max(0.0, now - (replica.get("launched_at") or now)))
    return f"{secs // 60}m{secs % 60:02d}s" if secs >= 60 else f"{secs}s"


def _table(name: str, svc: dict, now: float) -> Table:
    table = Table(title=f"{name}: {svc['status']} ({svc['replicas_ready']}/{svc['replicas_total']} ready)",
                  title_justify="left")
    for col in ("REPLICA", "ZONE", "MARKET", "STATE", "ELAPSED"):
        table.add_column(col)
    for r in svc["replicas"]:
        table.add_row(r["replica_id"], f"{r['cloud']}/{r['zone']}", r["market"], r["state"], _elapsed(r, now))
    return table


def _check(name: str, svc: dict) -> bool:
    """True when done; RuntimeFailure when the service FAILED."""
    if svc["status"] == "FAILED":
        why = next((r["status_message"] for r in reversed(svc["replicas"]) if r.get("status_message")), "")
        raise RuntimeFailure(f"service {name} FAILED{': ' + why if why else ''} (see `spotctl logs {name}`)")
    return svc["status"] == "READY" and svc["replicas_ready"] >= 1


def _updated(name: str, svc: dict) -> bool:
    return _check(name, svc) and not svc["update"]["in_progress"]


def wait_updated(client: DaemonClient, name: str, timeout: float, console: Console, quiet: bool) -> None:
    _wait(client, name, timeout, console, quiet, _updated, "updated")


def wait_ready(client: DaemonClient, name: str, timeout: float, console: Console, quiet: bool) -> None:
    _wait(client, name, timeout, console, quiet, _check, "READY")


def _wait(client: DaemonClient, name: str, timeout: float, console: Console, quiet: bool,
          done: Callable[[str, dict], bool], what: str) -> None:
    deadline = time.monotonic() + timeout
    if quiet:
        while time.monotonic() < deadline:
            if done(name, client.get(f"/v1/services/{name}")):
                return
            time.sleep(POLL_S)
    elif sys.stdout.isatty():
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            while time.monotonic() < deadline:
                svc = client.get(f"/v1/services/{name}")
                live.update(_table(name, svc, time.time()))
                if done(name, svc):
                    return
                time.sleep(POLL_S)
    else:
        seen: dict[str, str] = {}
        while time.monotonic() < deadline:
            svc = client.get(f"/v1/services/{name}")
            now = time.time()
            for r in svc["replicas"]:
                if seen.get(r["replica_id"]) != r["state"]:
                    seen[r["replica_id"]] = r["state"]
                    console.print(f"{r['replica_id']}  {r['cloud']}/{r['zone']}  {r['market']}  {r['state']}  "
                                  f"{_elapsed(r, now)}", highlight=False)
            if done(name, svc):
                return
            time.sleep(POLL_S)
    raise RuntimeFailure(f"service {name} not {what} after {timeout:.0f}s "
                         f"(see `spotctl status` and `spotctl logs {name}`)")
