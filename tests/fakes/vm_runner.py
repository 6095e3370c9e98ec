"""The machines of the emulated clouds: a VM's boot script run as a local process group.

An emulator (tests/fakes/emulated_*.py) starts a machine when its cloud reports an instance
running and stops it when the instance is gone. Each machine gets what a VM has of its own: a
home folder (its disk), a loopback address the emulator assigned as its private IP (Linux
routes all of 127.0.0.0/8 to lo), and a metadata server. The boot script runs unchanged but
for its install step (SPOT_ORCHESTRATOR_REPLICA_PYTHON points at the replica environment) and
the metadata address its watcher reads (SPOT_ORCHESTRATOR_METADATA_URL).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from orchestrator.common import procs
from orchestrator.common.paths import REPO_ROOT, replica_python


@dataclasses.dataclass
class Machine:
    instance_id: str
    private_ip: str
    home: Path
    process: subprocess.Popen
    scratch: Path  # its TMPDIR

    @property
    def log(self) -> Path:
        return self.home / "console.log"

    def alive(self) -> bool:
        return self.process.poll() is None


class VMRunner:
    """Starts and stops machines; everything it started is gone after `close()`."""

    def __init__(self, root: Path, models_dir: Path | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.models_dir = models_dir
        self.machines: dict[str, Machine] = {}
        self._lock = threading.Lock()

    def start(self, instance_id: str, boot_script: str, private_ip: str, metadata_url: str) -> Machine:
        with self._lock:
            if instance_id in self.machines:
                return self.machines[instance_id]
            home = self.root / instance_id.replace("/", "_")
            home.mkdir(parents=True, exist_ok=True)
            script = home / "boot.sh"
            script.write_text(boot_script)
            # Directly in the system's temp folder: vLLM's IPC sockets live in TMPDIR, and a unix
            # socket's path may not exceed 107 bytes.
            scratch = Path(tempfile.mkdtemp(prefix="vm-"))
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": str(home),
                "TMPDIR": str(scratch),
                "LANG": "C.UTF-8",
                # The two things the emulator changes: the install step, and the metadata address.
                "SPOT_ORCHESTRATOR_REPLICA_PYTHON": str(replica_python()),
                "SPOT_ORCHESTRATOR_METADATA_URL": metadata_url,
                # The replica environment imports this checkout (a worktree included).
                "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO_ROOT)),
            }
            if self.models_dir is not None:  # the tiny model, built once per test run
                env["SPOT_ORCHESTRATOR_MODELS"] = str(self.models_dir)
            with open(home / "console.log", "ab") as log:
                process = subprocess.Popen(["bash", str(script)], stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, env=env, cwd=home, start_new_session=True)
            procs.lower_machine_priority(process.pid)  # as the local cloud's machines: never starve the LB
            machine = Machine(instance_id, private_ip, home, process, scratch)
            self.machines[instance_id] = machine
            return machine

    def stop(self, instance_id: str, grace_s: float = 5.0) -> None:
        """The machine goes away: SIGTERM to its whole group, SIGKILL after `grace_s`."""
        with self._lock:
            machine = self.machines.pop(instance_id, None)
        if machine is None:
            return
        _signal(machine.process.pid, signal.SIGTERM)
        _signal(machine.process.pid, signal.SIGCONT)  # a held (SIGSTOPped) engine must see the SIGTERM
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and procs.group_members(machine.process.pid):
            time.sleep(0.1)
        _signal(machine.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            machine.process.wait(timeout=10)
        shutil.rmtree(machine.scratch, ignore_errors=True)

    def running(self) -> list[str]:
        with self._lock:
            return [i for i, m in self.machines.items() if procs.group_members(m.process.pid)]

    def logs(self, lines: int = 60) -> str:
        """The tail of every machine's console and boot log (for a failing test's report)."""
        out = []
        for path in sorted(self.root.glob("*/console.log")) + sorted(self.root.glob("*/.spot-orchestrator/boot.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.relative_to(self.root)}\n" + "\n".join(text))
        return "\n".join(out)

    def close(self) -> None:
        for instance_id in list(self.machines):
            self.stop(instance_id, grace_s=2.0)


def _signal(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
