"""Service verbs: up, update, status, logs, down, events, chaos, daemon (the `sky serve` surface)."""

from __future__ import annotations

import enum
import json
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from orchestrator.cli.client import DaemonClient
from orchestrator.cli.wait import wait_ready, wait_updated
from orchestrator.control.tls import service_tls
from orchestrator.control.discovery import DEFAULT_PORT, DaemonStartFailed
from orchestrator.common.errors import RuntimeFailure, UserError

# A pipe (no terminal) gets whole tables, not 80 columns of wrapped cells.
console = Console(width=None if sys.stdout.isatty() else 200)
chaos_app = typer.Typer(help="Inject failures to watch failover happen.", no_args_is_help=True)


def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    secs = max(0, time.time() - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs / size:.0f}{unit} ago"
    return f"{secs:.0f}s ago"


def _duration(secs: float) -> str:
    secs = int(secs)
    h, rem = divmod(secs, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def up(
    spec_file: Path = typer.Argument(..., help="Service YAML (SkyServe-style `service:` + `resources:` + `engine:`)."),
    name: str = typer.Option(None, "--name", "-n", help="Service name (default: the YAML's `name` or file stem)."),
    env: list[str] = typer.Option([], "--env", help="K=V for the spec's `envs` (K alone: from this environment)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the replicas it would launch; launch nothing."),
    wait: bool = typer.Option(False, "--wait", help="Show each replica's progress until one is READY "
                                                     "(exit 1 at once if the service FAILED)."),
    timeout: float = typer.Option(900, "--timeout", help="Seconds to wait with --wait."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Start or update a service (starts the daemon in the background when none runs)."""
    spec = _load(spec_file)
    envs = env_values(env, spec.task.get("envs") or {})
    if dry_run:
        _dry_run(spec, as_json)
        return
    client = DaemonClient.connect(start=True)
    result = _send(client, spec_file, name or spec.name, envs, UpdateMode.rolling)
    if wait:
        wait_ready(client, result["name"], timeout, console, quiet=as_json)
    if as_json:
        typer.echo(json.dumps(result))
        return
    console.print(f"service [bold]{result['name']}[/] is starting; endpoint {result['endpoint']}")
    console.print("  watch it:  spotctl status")
    console.print(f"  try it:    curl {result['endpoint']}/v1/completions -H 'Content-Type: application/json' "
                  f"-d '{{\"model\": \"{result['name']}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'")


class UpdateMode(str, enum.Enum):
    rolling = "rolling"
    blue_green = "blue-green"


def update(
    spec_file: Path = typer.Argument(..., help="The service's changed YAML."),
    name: str = typer.Option(None, "--name", "-n", help="Service name (default: the YAML's `name`)."),
    mode: UpdateMode = typer.Option(UpdateMode.rolling, "--mode", help="rolling: one replica at a time; "
                                    "blue-green: the whole new set READY, then the old one drained."),
    env: list[str] = typer.Option([], "--env", help="K=V for the spec's `envs` (K alone: from this environment)."),
    wait: bool = typer.Option(False, "--wait", help="Show the replicas until every old one is replaced."),
    timeout: float = typer.Option(1800, "--timeout", help="Seconds to wait with --wait."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Update a running service: replicas whose launch fields changed are replaced, the rest applies in place."""
    spec = _load(spec_file)
    envs = env_values(env, spec.task.get("envs") or {})
    client = DaemonClient.connect(start=True)
    name = name or spec.name
    client.get(f"/v1/services/{name}")  # an unknown service: a one-line 404 (exit 2), nothing started
    result = _send(client, spec_file, name, envs, mode)
    if wait:
        wait_updated(client, name, timeout, console, quiet=as_json)
    if as_json:
        typer.echo(json.dumps(result))
        return
    upd = result["update"] or {}
    if upd.get("replacing"):
        console.print(f"service [bold]{name}[/]: {upd['mode']} update to revision {upd['revision']}, "
                      f"{upd['replacing']} replica(s) to replace" + ("" if wait else "; watch it: spotctl status"))
    else:
        console.print(f"service [bold]{name}[/]: updated in place (no replica to replace)")


def _load(spec_file: Path):
    from orchestrator.spec import load_spec

    if not spec_file.exists():
        raise UserError(f"{spec_file}: no such file")
    spec = load_spec(spec_file)  # validate here too: errors without a round trip
    service_tls(spec)  # missing or unreadable TLS files: one line, before the daemon starts
    return spec


def _send(client: DaemonClient, spec_file: Path, name: str, envs: dict, mode: UpdateMode) -> dict:
    return client.post("/v1/services", json={"yaml": spec_file.read_text(), "name": name, "envs": envs,
                                             "update_mode": mode.value})


def env_values(pairs: list[str], declared: dict) -> dict[str, str]:
    """`--env K=V` / `--env K` (K's value here), and the spec's empty (null) envs filled from
    this environment; raises UserError for a malformed pair or a K set nowhere."""
    import os

    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not key or not key.replace("_", "a").isalnum():
            raise UserError(f"--env {pair!r}: expected KEY=VALUE or KEY")
        if not sep:
            if key not in os.environ:
                raise UserError(f"--env {key}: not set in this environment; pass --env {key}=VALUE")
            value = os.environ[key]
        values[key] = value
    for key, default in declared.items():
        if key not in values and default is None and key in os.environ:
            values[str(key)] = os.environ[key]
    return values


def _dry_run(spec, as_json: bool) -> None:
    from orchestrator.control.plan import plan, total_per_hour

    launches = plan(spec)
    if as_json:
        typer.echo(json.dumps([p.as_dict() for p in launches]))
        return
    table = Table(title=f"{spec.name}: {len(launches)} replica(s) planned, ${total_per_hour(launches):.4f}/h "
                        "(nothing launched)")
    for col in ("replica", "cloud", "region", "zone", "instance type", "accelerator", "market", "$/h", "price",
                "boot script"):
        table.add_column(col)
    for p in launches:
        age = f"{p.price_source or '?'}, {_age(p.price_age_s)}"
        boot = f"{p.boot_script_bytes} B" if p.boot_script_bytes is not None else "-"
        table.add_row(p.replica, p.cloud, p.region, p.zone, p.instance_type, f"{p.accelerator}:{p.accelerator_count}",
                      p.market, f"{p.price_per_hour:.4f}", age, boot)
    console.print(table)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "age unknown"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} old"
    return f"{seconds:.0f}s old"


def status(
    service: str = typer.Argument(None, help="Only this service."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Add policy and resources."),
    all_replicas: bool = typer.Option(False, "--all", "-a", help="Include terminated replicas."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Show services and their replicas."""
    client = DaemonClient.connect(start=True)
    services = [client.get(f"/v1/services/{service}")] if service else client.get("/v1/services")
    terminal = {"TERMINATED", "FAILED", "FAILED_INITIAL_DELAY", "FAILED_PROBING", "FAILED_PROVISION",
                "FAILED_CLEANUP", "PREEMPTED"}
    if not all_replicas:
        for svc in services:
            # The most recent terminal replicas stay visible: a preemption should be seen.
            dead = [r for r in svc["replicas"] if r["state"] in terminal][-5:]
            svc["replicas"] = [r for r in svc["replicas"] if r["state"] not in terminal or r in dead]
    if as_json:
        typer.echo(json.dumps(services if not service else services[0], indent=2))
        return
    if not services:
        console.print("no services (start one with `spotctl up service.yaml`)")
        return
    st = Table(title="Services", title_justify="left")
    verbose_cols = ("POLICY", "LB", "RESOURCES") if verbose else ()
    for col in ("NAME", "STATUS", "REPLICAS", "ENDPOINT", "UPTIME", "UPDATE", *verbose_cols):
        st.add_column(col)
    for svc in services:
        upd = svc["update"]
        progress = f"{upd['mode']}: {upd['old']} old, {upd['new']} new" if upd["in_progress"] else "-"
        row = [svc["name"], svc["status"], f"{svc['replicas_ready']}/{svc['replicas_total']}", svc["endpoint"] or "-",
               _duration(svc["uptime_s"]), progress]
        if verbose:
            row += [svc["policy"], svc["load_balancing_policy"], json.dumps(svc["resources"])]
        st.add_row(*row)
    console.print(st)
    rt = Table(title="Replicas", title_justify="left")
    for col in ("SERVICE", "ID", "ZONE", "MARKET", "STATUS", "ENDPOINT", "LAUNCHED", "PRICE/H"):
        rt.add_column(col)
    for svc in services:
        for r in svc["replicas"]:
            price = f"${r['price_per_hour']:.3f}" if r["price_per_hour"] is not None else "-"
            rt.add_row(svc["name"], r["replica_id"], f"{r['cloud']}/{r['zone']}", r["market"], r["state"],
                       r["endpoint"] or "-", _ago(r["launched_at"]), price)
    console.print(rt)


def logs(
    service: str = typer.Argument(None, help="Service name."),
    replica: str = typer.Argument(None, help="Replica id (default: every replica)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
    lines: int = typer.Option(50, "--lines", "-n", min=0, help="Lines of history per log."),
    daemon_log: bool = typer.Option(False, "--daemon", help="The daemon's own log."),
    lb_log: bool = typer.Option(False, "--lb", help="The load balancer's log (of SERVICE when it has its own)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line: {source, line}."),
) -> None:
    """Print a service's replica logs, or the daemon's (--daemon) or load balancer's (--lb)."""
    from orchestrator.common import logsetup

    if daemon_log and lb_log:
        raise UserError("give --daemon or --lb, not both")
    if daemon_log or lb_log:
        if replica:
            raise UserError("a replica id goes with a service's replica logs, not --daemon / --lb")
        source, path = ("daemon", logsetup.daemon_log()) if daemon_log else ("lb", logsetup.lb_log(service))
        if not path.exists():
            raise RuntimeFailure(f"no {source} log at {path} yet")
        paths = [(source, path)]
    else:
        if not service:
            raise UserError("name a service (or pass --daemon or --lb)")
        client = DaemonClient.connect(start=True)
        entries = client.get(f"/v1/services/{service}/logs")["replicas"]
        if replica:
            entries = [e for e in entries if e["replica_id"] == replica]
            if not entries:
                raise UserError(f"service {service} has no replica {replica!r}")
        paths = [(e["replica_id"], Path(e["log_path"])) for e in entries
                 if e["log_path"] and Path(e["log_path"]).exists()]
        if not paths:
            raise RuntimeFailure(f"no logs for {replica or service} on this machine")
    prefix = len(paths) > 1

    def emit(source: str, line: str) -> None:
        if as_json:
            typer.echo(json.dumps({"source": source, "line": line.rstrip("\n")}))
        else:
            typer.echo(f"({source}) {line}" if prefix else line, nl=False)

    handles = []
    for source, path in paths:
        f = path.open("r", errors="replace")
        for line in f.readlines()[-lines:] if lines else []:
            emit(source, line)
        handles.append((source, f))
    while follow:
        idle = True
        for source, f in handles:
            line = f.readline()
            while line:
                idle = False
                emit(source, line)
                line = f.readline()
        if idle:
            time.sleep(0.3)


def down(
    services: list[str] = typer.Argument(None, help="Services to tear down."),
    all_services: bool = typer.Option(False, "--all", "-a", help="Tear down every service (and orphan machines)."),
    orphans: bool = typer.Option(False, "--orphans", help="With --all: also every managed machine of the clouds "
                                 "this state used, whatever the state database says (recovers a lost one)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until every replica is gone."),
    timeout: float = typer.Option(120, "--timeout"),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Tear down services: every replica process/instance is terminated (asks first unless -y)."""
    if not services and not all_services:
        raise UserError("name a service, or pass --all")
    if orphans and not all_services:
        raise UserError("--orphans goes with --all")
    try:
        client = DaemonClient.connect(start=True)
    except DaemonStartFailed:
        if not orphans:
            raise
        _terminate_every_machine(wait, timeout)  # no daemon can start (a lost state): the clouds directly
        return
    names = [s["name"] for s in client.get("/v1/services")] if all_services else list(services)
    for name in names if not all_services else ():
        client.get(f"/v1/services/{name}")  # an unknown name: a one-line 404 before anything is asked
    if names and not yes:
        if not sys.stdin.isatty():
            raise UserError(f"down: not tearing down {', '.join(names)} without confirmation; pass -y "
                            "(no terminal to ask on)")
        if not typer.confirm(f"Tear down {', '.join(names)} and terminate every replica?", default=False):
            raise RuntimeFailure("down: not confirmed; nothing was torn down")
    for name in names:
        client.delete(f"/v1/services/{name}")
    deadline = time.monotonic() + timeout
    pending = set(names)
    while wait and pending and time.monotonic() < deadline:
        remaining = {s["name"] for s in client.get("/v1/services")}
        pending &= remaining
        if pending:
            time.sleep(0.5)
    if wait and pending:
        raise RuntimeFailure(f"still shutting down after {timeout:.0f}s: {', '.join(sorted(pending))}")
    state = "down" if wait else "shutting down"
    if as_json:
        typer.echo(json.dumps([{"name": name, "status": state} for name in names]))
        return
    for name in names:
        console.print(f"service {name}: {state}")
    if all_services:  # machines no service owns (a lost or restored state, a crash): now, not after the grace
        found = client.delete("/v1/orphans")
        while wait and found and time.monotonic() < deadline:
            time.sleep(0.5)
            found = client.delete("/v1/orphans")
        if wait and found:
            raise RuntimeFailure(f"{len(found)} orphan machine(s) still running after {timeout:.0f}s")
        if found or not names:
            console.print(f"orphan machines: {len(found)} left" if found else "no orphan machines")


def _terminate_every_machine(wait: bool, timeout: float) -> None:
    from orchestrator.control.orphans import clouds_in_use, live_machines
    from providers import registry

    providers: dict = {}

    def provider(cloud: str):
        if cloud not in providers:
            providers[cloud] = registry.make(cloud)
        return providers[cloud]

    clouds = clouds_in_use(None)
    machines = live_machines(clouds, provider)
    for inst in machines:
        provider(inst.location.cloud).terminate(inst.instance_id)
    deadline = time.monotonic() + timeout
    left = live_machines(clouds, provider)
    while wait and left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = live_machines(clouds, provider)
    for p in providers.values():
        p.close()
    if wait and left:
        raise RuntimeFailure(f"{len(left)} machine(s) still running after {timeout:.0f}s")
    console.print(f"terminated {len(machines)} managed machine(s) on {', '.join(clouds) or 'no cloud'} "
                  "(the daemon could not start); move an unreadable state database aside before `spotctl up`")


def events(
    service: str = typer.Argument(None, help="Only this service."),
    limit: int = typer.Option(50, "--limit", "-n"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Recent events: transitions, launches, notices, preemptions, capacity errors."""
    client = DaemonClient.connect(start=True)
    rows = client.get("/v1/events", params={"service": service, "limit": limit} if service else {"limit": limit})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="Events", title_justify="left")
    for col in ("TIME", "SERVICE", "REPLICA", "KIND", "ZONE", "MESSAGE"):
        table.add_column(col)
    for e in rows:
        table.add_row(time.strftime("%H:%M:%S", time.localtime(e["at"])), e["service"] or "-", e["replica_id"] or "-",
                      e["kind"], e["zone"] or "-", e["message"])
    console.print(table)


@chaos_app.command("preempt")
def chaos_preempt(
    replica: str = typer.Argument(None, help="Replica id to preempt."),
    zone: str = typer.Option(None, "--zone", help="Preempt every live replica in this zone."),
    grace: float = typer.Option(30, "--grace", min=0, help="Seconds between the notice and the kill."),
    service: str = typer.Option(None, "--service", help="Limit --zone to one service."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Send a preemption notice, then kill at the deadline (local cloud: SIGKILL)."""
    if bool(replica) == bool(zone):
        raise UserError("give a replica id or --zone ZONE (exactly one)")
    client = DaemonClient.connect(start=True)
    result = client.post("/v1/chaos/preempt", json={"replica_id": replica, "zone": zone, "grace_s": grace,
                                                   "service": service})
    if as_json:
        typer.echo(json.dumps(result))
    else:
        console.print(f"notice sent to {', '.join(result['preempted'])}; killed in {grace:.0f}s")


def daemon(
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(DEFAULT_PORT, "--port",
                             help="API port (0 = any free port)."),
    public_url: str = typer.Option(None, "--public-url",
                                   help="The URL replica VMs reach the daemon at (or $SPOT_ORCHESTRATOR_PUBLIC_URL)."),
    tls_certfile: str = typer.Option(None, "--tls-certfile", help="The API's certificate (needed beyond loopback; "
                                     "or $SPOT_ORCHESTRATOR_API_CERTFILE)."),
    tls_keyfile: str = typer.Option(None, "--tls-keyfile", help="Its key (or $SPOT_ORCHESTRATOR_API_KEYFILE)."),
    plain_http: bool = typer.Option(False, "--plain-http", help="Beyond loopback without TLS (a TLS proxy in front)."),
) -> None:
    """Run the control plane in the foreground (jobs + HTTP API)."""
    from orchestrator.control.daemon import serve

    serve(host, port, public_url, tls_certfile, tls_keyfile, plain_http)


def register(app: typer.Typer) -> None:
    app.command()(up)
    app.command()(update)
    app.command()(status)
    app.command()(logs)
    app.command()(down)
    app.command()(events)
    app.command()(daemon)
    app.add_typer(chaos_app, name="chaos")
