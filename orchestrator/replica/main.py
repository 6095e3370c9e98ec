"""Replica entry point (replica side, stdlib only): start the agent, then become vLLM.

    python -m orchestrator.replica.main --agent-port P --secret-file F [--store-max-bytes N] \
        [--watch CLOUD --api DAEMON_URL] -- <vLLM OpenAI server arguments>

The daemon's launcher (orchestrator.control.launch) makes this every replica machine's command.
The agent (shard store + notice watcher) is started as a child in the same process group, so
the provider's kill of the group (a preemption) takes both down together, as a real machine
going away would. Then this process execs vLLM's OpenAI server: the instance's main pid is the
engine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


SECRET_ENV = "SPOT_ORCHESTRATOR_KV_SECRET"


def materialize_secret(path: str) -> None:
    """On a cloud VM the service's KV secret arrives in the environment (the startup
    script); the agent and the connector read it from the configured file, so write it
    there once, readable by this user only."""
    secret = os.environ.pop(SECRET_ENV, None)
    if not secret or os.path.exists(path):
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: replica_main [agent options] -- <vllm server args>", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="replica_main")
    parser.add_argument("--agent-port", type=int)
    parser.add_argument("--secret-file")
    parser.add_argument("--store-max-bytes", type=int)
    parser.add_argument("--watch", metavar="CLOUD", help="run this cloud's notice watcher")
    parser.add_argument("--api", help="the daemon's URL, for notices")
    opts = parser.parse_args(argv[:split])
    engine_args = argv[split + 1 :]
    if opts.secret_file:
        materialize_secret(opts.secret_file)
    if opts.agent_port:
        agent = [sys.executable, "-m", "orchestrator.replica.agent", "--store-port", str(opts.agent_port)]
        if opts.secret_file:
            agent += ["--secret-file", opts.secret_file]
        if opts.store_max_bytes:
            agent += ["--max-bytes", str(opts.store_max_bytes)]
        if opts.watch and opts.api:
            agent += ["--watch", opts.watch, "--api", opts.api]
        subprocess.Popen(agent, stdin=subprocess.DEVNULL)
    engine = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine_args]
    sys.stdout.flush()
    os.execv(sys.executable, engine)
    return 0  # unreachable


if __name__ == "__main__":
    sys.exit(main())
