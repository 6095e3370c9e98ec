"""Replica entry point (replica side: stdlib and httpx): start the agent, then become vLLM.

    python -m orchestrator.replica.main [--agent-port P --secret-file F [--tls-dir D]] [--watch CLOUD --api URL]
        [--cloud CLOUD --daemon URL --bootstrap-token T --home DIR] -- <vLLM server arguments>

On a VM (the boot script passes --bootstrap-token) it first learns its instance id and private
address from the cloud's metadata service (the provider's in-VM watcher), redeems the token with
the daemon for the service's KV secret, its shard store's TLS files (written under {home}/kv-tls)
and environment, and fills the {host}, {home} and {secret_file} placeholders. The agent runs as
a child in the same process group, so the machine's end takes both down; then this process execs
vLLM's OpenAI server.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from importlib import metadata

SECRET_ENV = "SPOT_ORCHESTRATOR_KV_SECRET"
# The emulated clouds of the tests point the metadata watcher elsewhere; a VM leaves it unset.
METADATA_URL_ENV = "SPOT_ORCHESTRATOR_METADATA_URL"
REDEEM_PATIENCE_S = 900.0  # the daemon records the instance only once its launch call returns


class BootError(Exception):
    """The replica cannot start: its message is the one line the boot log shows."""


def materialize_secret(path: str, secret: str | None = None) -> None:
    """Write the service's KV secret where the agent and the connector read it (0600), once.
    Without `secret`, take it from the environment (the older, pre-bootstrap path)."""
    secret = secret or os.environ.pop(SECRET_ENV, None)
    if not secret or os.path.exists(path):
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)


def materialize_tls(folder: str, granted: dict | None) -> None:
    """Write the store's TLS files from the redemption (CA, certificate; the key 0600)."""
    from orchestrator.common import kvtls

    if not granted:
        return
    os.makedirs(folder, mode=0o700, exist_ok=True)
    for name, field in ((kvtls.CA_FILE, "ca"), (kvtls.CERT_FILE, "cert"), (kvtls.KEY_FILE, "key")):
        fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(granted[field])


def machine_identity(cloud: str, metadata_url: str | None) -> tuple[str, str]:
    """(instance id, private address) from the cloud's metadata service."""
    import httpx  # the replica runtime has it; the local cloud never gets here

    from orchestrator.replica.watchers import load_watcher

    watcher = load_watcher(cloud)(**({"base_url": metadata_url} if metadata_url else {}))
    with httpx.Client(timeout=5.0) as client:
        deadline = time.monotonic() + 120
        while True:
            try:
                return watcher.identity(client)
            except (httpx.HTTPError, ValueError) as err:
                if time.monotonic() > deadline:
                    raise BootError(f"the {cloud} metadata service did not answer: {err}") from None
                time.sleep(2)


def redeem(daemon: str, token: str, instance_id: str, patience_s: float = REDEEM_PATIENCE_S) -> dict:
    """The daemon's answer to the bootstrap token: {service, replica_id, kv_secret, env}."""
    import httpx

    body = {"instance_id": instance_id, "version": metadata.version("spot-orchestrator")}
    deadline = time.monotonic() + patience_s
    with httpx.Client(timeout=15.0, headers={"Authorization": f"Bootstrap {token}"}) as client:
        while True:
            try:
                reply = client.post(f"{daemon.rstrip('/')}/v1/bootstrap/redeem", json=body)
                if reply.status_code == 200:
                    return reply.json()
                if reply.status_code != 409 and reply.status_code < 500:  # refused for good (used, not ours)
                    raise BootError(f"the daemon refused the bootstrap token: HTTP {reply.status_code} "
                                    f"{reply.text[:300]}")
                why = f"HTTP {reply.status_code} {reply.text[:300]}"
            except (httpx.HTTPError, ValueError) as err:
                why = str(err)
            if time.monotonic() > deadline:
                raise BootError(f"could not redeem the bootstrap token at {daemon}: {why}")
            time.sleep(3)


def fill(args: list[str], values: dict[str, str]) -> list[str]:
    out = []
    for arg in args:
        for name, value in values.items():
            arg = arg.replace("{" + name + "}", value)
        out.append(arg)
    return out


def _model_arg(engine_args: list[str], home: str) -> list[str]:
    """`--model tiny` on a VM: the demo model, built here (a CPU build of vLLM in the tests)."""
    if "--model" not in engine_args:
        return engine_args
    i = engine_args.index("--model") + 1
    if i < len(engine_args) and engine_args[i] == "tiny":
        from pathlib import Path

        from orchestrator.replica.demo_model import ensure_demo_model

        root = os.environ.get("SPOT_ORCHESTRATOR_MODELS") or os.path.join(home, "models")
        engine_args = [*engine_args[:i], str(ensure_demo_model("tiny", Path(root))), *engine_args[i + 1:]]
    return engine_args


def boot(opts: argparse.Namespace, replica_args: list[str], engine_args: list[str]) -> tuple[list[str], list[str]]:
    """The VM half: identity, secrets, placeholders. Returns the filled argument lists."""
    home = os.path.expanduser(opts.home or "~/.spot-orchestrator")
    os.makedirs(home, mode=0o700, exist_ok=True)
    metadata_url = os.environ.get(METADATA_URL_ENV)
    instance_id, address = machine_identity(opts.cloud, metadata_url)
    granted = redeem(opts.daemon, opts.bootstrap_token, instance_id)
    secret_file = os.path.join(home, "kv.secret")
    materialize_secret(secret_file, granted["kv_secret"])
    materialize_tls(os.path.join(home, "kv-tls"), granted.get("kv_tls"))
    os.environ.update({str(k): str(v) for k, v in (granted.get("env") or {}).items()})
    values = {"host": address, "home": home, "secret_file": secret_file}
    if metadata_url:
        replica_args = [*replica_args, "--metadata-url", metadata_url]
    print(f"replica {granted['replica_id']}: instance {instance_id} at {address}", flush=True)
    return fill(replica_args, values), _model_arg(fill(engine_args, values), home)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.replica.main")
    parser.add_argument("--agent-port", type=int)
    parser.add_argument("--secret-file")
    parser.add_argument("--store-max-bytes", type=int)
    parser.add_argument("--store-ttl", type=float, help="seconds a shard lives after its last use (kv.ttl_seconds)")
    parser.add_argument("--tls-dir", help="the shard store's certificate, key and the service CA")
    parser.add_argument("--watch", metavar="CLOUD", help="run this cloud's notice watcher")
    parser.add_argument("--api", help="the daemon's URL, for notices")
    parser.add_argument("--metadata-url", help="the metadata service's URL, if not the cloud's own")
    parser.add_argument("--cloud", help="the cloud whose metadata service says who this machine is (a VM)")
    parser.add_argument("--daemon", help="the daemon's URL, to redeem the bootstrap token (a VM)")
    parser.add_argument("--bootstrap-token", help="the one-time token from the boot script (a VM)")
    parser.add_argument("--home", help="this replica's own folder on the machine (a VM)")
    if "--" not in argv:
        parser.error("expected [options] -- <vLLM server arguments>")
    split = argv.index("--")
    opts = parser.parse_args(argv[:split])
    if opts.bootstrap_token and not (opts.cloud and opts.daemon):
        parser.error("--bootstrap-token needs --cloud and --daemon")
    return opts, argv[split + 1:]


def agent_command(opts: argparse.Namespace) -> list[str] | None:
    if not (opts.agent_port or (opts.watch and opts.api)):
        return None
    agent = [sys.executable, "-m", "orchestrator.replica.agent"]
    if opts.agent_port:
        agent += ["--store-port", str(opts.agent_port)]
    if opts.secret_file:
        agent += ["--secret-file", opts.secret_file]
    if opts.store_max_bytes:
        agent += ["--max-bytes", str(opts.store_max_bytes)]
    if opts.store_ttl:
        agent += ["--ttl", f"{opts.store_ttl:g}"]
    if opts.tls_dir and opts.agent_port:
        agent += ["--tls-dir", opts.tls_dir]
    if opts.host:
        agent += ["--host", opts.host]
    if opts.watch and opts.api:
        agent += ["--watch", opts.watch, "--api", opts.api]
    if opts.metadata_url:
        agent += ["--metadata-url", opts.metadata_url]
    return agent


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    opts, engine_args = parse(argv)
    if opts.bootstrap_token:
        split = argv.index("--")
        try:
            replica_args, engine_args = boot(opts, argv[:split], engine_args)
        except BootError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        opts, engine_args = parse([*replica_args, "--", *engine_args])
    opts.host = engine_args[engine_args.index("--host") + 1] if "--host" in engine_args else None
    if opts.secret_file:
        materialize_secret(opts.secret_file)
    agent = agent_command(opts)
    if agent is not None:
        subprocess.Popen(agent, stdin=subprocess.DEVNULL)
    engine = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine_args]
    sys.stdout.flush()
    os.execv(sys.executable, engine)
    return 0  # unreachable


if __name__ == "__main__":
    sys.exit(main())
