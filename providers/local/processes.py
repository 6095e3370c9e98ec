"""The local cloud's machines as process groups: start, signal, wait for, kill; scratch folders.

A machine is a detached process group (its own session); liveness comes from
`orchestrator.common.procs` (psutil), and children this interpreter started are reaped so a
dead one does not linger as a zombie. Used by providers.local.provider only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

from orchestrator.common import procs


def scratch_dir(instance_id: str) -> Path:
    # Directly in the system's temp folder, not under the cloud's root: a unix socket's path
    # (vLLM's IPC sockets live here) may not exceed 107 bytes.
    return Path(tempfile.gettempdir()) / f"spot-{instance_id}"


_CHILDREN: dict[int, subprocess.Popen] = {}  # processes this interpreter started: reap them


def track(proc: subprocess.Popen) -> None:
    """Remember a machine this interpreter started, so that it is reaped when it ends."""
    _CHILDREN[proc.pid] = proc


def reap(pid: int) -> None:
    child = _CHILDREN.get(pid)
    if child is not None and child.poll() is not None:
        del _CHILDREN[pid]


def pid_alive(pid: int, create_time: float | None) -> bool:
    reap(pid)  # a child of ours stays a zombie (and its pid taken) until it is waited for
    return procs.pid_alive(pid, create_time)


def signal_group(pgid: int, sig: int) -> None:
    if pgid <= 1 or pgid == os.getpgrp():  # never signal ourselves or init, whatever a record says
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        reap(pgid)
        if not procs.group_members(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def kill_group(pgid: int, stop_timeout_s: float) -> None:
    """SIGTERM the whole group, SIGKILL what is left after stop_timeout_s; wait until empty."""
    signal_group(pgid, signal.SIGTERM)
    if not wait_group_gone(pgid, stop_timeout_s):
        signal_group(pgid, signal.SIGKILL)
        wait_group_gone(pgid, 10.0)


def find_by_env(key: str, value: str) -> list[int]:
    """Pids of this user's processes whose environment has key=value (a machine whose launcher
    died before recording its pid is found by the instance id it was given)."""
    # environ is None for a process that is not ours to read (psutil's AccessDenied value).
    return [process.pid for process in psutil.process_iter(["environ"])
            if (process.info["environ"] or {}).get(key) == value]


def free_port(avoid: set[int]) -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port


def substitute(text: str, values: Mapping[str, str]) -> str:
    # str.replace, not str.format: commands carry JSON (e.g. --kv-transfer-config '{...}').
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return text
