"""Real processes for the vLLM tests: shard stores (agents) and vLLM CPU servers.

Each process gets its own session (process group), so a kill takes vLLM's engine and worker
children with it, the way a preempted machine disappears. `Processes` kills whatever it
started when the test ends, pass or fail.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from orchestrator.common.procs import lower_machine_priority
from tests.helpers import free_port

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1"}


class Processes:
    def __init__(self, python: Path, log_dir: Path):
        self.python = python
        self.log_dir = log_dir
        self._procs: dict[str, subprocess.Popen] = {}
        self._scratch: dict[str, str] = {}

    def start(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        # A TMPDIR of its own, as the local cloud gives its machines (vLLM's IPC sockets, which
        # a SIGKILLed engine leaves behind); short, for the 107-byte limit of a socket's path.
        scratch = self._scratch[name] = tempfile.mkdtemp(prefix="spot-test-")
        proc = subprocess.Popen([str(self.python), *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, "TMPDIR": scratch, **(env or {})},
                                start_new_session=True)
        log.close()
        lower_machine_priority(proc.pid)  # as the local cloud runs its machines
        self._procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def kill(self, name: str) -> None:
        proc = self._procs.pop(name, None)
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)
        shutil.rmtree(self._scratch.pop(name), ignore_errors=True)

    def freeze(self, name: str) -> None:
        """SIGSTOP the process group at once: it produces nothing more until killed, so a test
        that kills a replica mid-stream does not race the replica finishing the stream."""
        proc = self._procs.get(name)
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass

    def kill_all(self) -> None:
        for name in list(self._procs):
            self.kill(name)


def wait_until(check, what: str, proc: subprocess.Popen, log: callable, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what}: process exited ({proc.returncode}):\n{log()[-4000:]}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"{what}: not ready after {timeout_s:.0f}s:\n{log()[-4000:]}")


def start_store(procs: Processes, name: str, secret_file: Path, extra: list[str] = ()) -> str:
    port = free_port()
    proc = procs.start(name, ["-m", "orchestrator.replica.agent", "--store-port", str(port),
                              "--secret-file", str(secret_file), *extra])
    endpoint = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {secret_file.read_text().strip()}"}
    wait_until(lambda: httpx.get(f"{endpoint}/healthz", headers=headers, timeout=2).status_code == 200,
               f"store {name}", proc, lambda: procs.log(name), timeout_s=120)
    return endpoint


def start_vllm(procs: Processes, name: str, model: Path, *, kv_config: dict | None = None,
               max_model_len: int = 1024, dtype: str = "bfloat16") -> str:
    port = free_port()
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--enforce-eager", "--block-size", "32"]
    if kv_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_config)]
    proc = procs.start(name, args, env=VLLM_ENV)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200,
               f"vLLM {name}", proc, lambda: procs.log(name), timeout_s=900)
    return base


def greedy_token_ids(base: str, model: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """The token ids vLLM generates greedily after a prompt given as token ids."""
    response = httpx.post(f"{base}/v1/completions", timeout=600, json={
        "model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    response.raise_for_status()
    ids = response.json()["choices"][0]["token_ids"]
    assert len(ids) == max_tokens, response.text[:500]
    return ids
