"""Real shard stores for tests: `python -m orchestrator.replica.agent` subprocesses on 127.0.0.1.

`store_tls_dir` issues a store the TLS files the daemon would (the service's CA, its certificate,
its key), for `StoreProcess(..., extra=["--tls-dir", folder])`; it needs SPOT_ORCHESTRATOR_HOME set,
where the service's CA is kept.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from orchestrator.common.paths import REPO_ROOT, replica_python

SECRET = "test-kv-secret"


def agent_python() -> str:
    """The replica runtime's interpreter when it is set up, else this one (same code)."""
    replica = replica_python()
    return str(replica) if replica.exists() else sys.executable


class StoreProcess:
    """One agent serving a shard store on a free port; stop() or kill() it."""

    def __init__(self, secret_file: Path, max_bytes: int = 256 << 20, ttl_s: float = 3600.0,
                 extra: list[str] | None = None, port: int = 0):
        self.proc = subprocess.Popen(
            [agent_python(), "-m", "orchestrator.replica.agent", "--store-port", str(port),
             "--secret-file", str(secret_file),
             "--max-bytes", str(max_bytes), "--ttl", str(ttl_s), *(extra or [])],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        self.lines: list[str] = []
        ready = threading.Event()
        self.endpoint = ""

        def read() -> None:  # keep draining stderr so the agent never blocks on a full pipe
            for line in self.proc.stderr:
                self.lines.append(line)
                found = re.search(r"listening on (http://\S+)", line)
                if found:
                    self.endpoint = found.group(1)
                    ready.set()
            ready.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not ready.wait(60) or not self.endpoint:
            self.kill()
            raise RuntimeError(f"shard store did not start: {''.join(self.lines)[-2000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def store_tls_dir(root: Path, service: str, node_id: str) -> Path:
    """`root/<service>/<node_id>` holding the store's TLS files, issued by the service's CA."""
    from orchestrator.control.kvtls import issue, write_credentials

    return write_credentials(root / service / node_id, issue(service, node_id))


def secret_file(tmp_path: Path, secret: str = SECRET) -> Path:
    path = tmp_path / "kv-secret"
    path.write_text(secret + "\n")
    return path


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss
