"""Replica entry point (replica side, stdlib only): start the agent, then become vLLM.

    python -m orchestrator.replica_main --agent-port P --secret-file F [--store-max-bytes N] \
        -- <vLLM OpenAI server arguments>

The agent (shard store + notice watchers) is started as a child in the same process
group, so the provider's kill of the group (a preemption) takes both down together, as a
real machine going away would. Then this process execs vLLM's OpenAI server: the
instance's main pid is the engine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


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
    parser.add_argument("--agent-arg", action="append", default=[], help="extra argument for the agent")
    opts = parser.parse_args(argv[:split])
    engine_args = argv[split + 1 :]
    if opts.agent_port:
        agent = [sys.executable, "-m", "orchestrator.agent", "--store-port", str(opts.agent_port)]
        if opts.secret_file:
            agent += ["--secret-file", opts.secret_file]
        if opts.store_max_bytes:
            agent += ["--max-bytes", str(opts.store_max_bytes)]
        agent += opts.agent_arg
        subprocess.Popen(agent, stdin=subprocess.DEVNULL)
    engine = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine_args]
    sys.stdout.flush()
    os.execv(sys.executable, engine)
    return 0  # unreachable


if __name__ == "__main__":
    sys.exit(main())
