"""Is a process alive, through psutil. And the CPU priority of the local cloud's machines.

A zombie still answers `os.kill(pid, 0)`, and a pid can be reused by another process; psutil
tells both apart (its status, and its creation time). The CLI checks the daemon's pid with it,
the local cloud its replicas' processes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import psutil

_DEAD = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


@dataclasses.dataclass(frozen=True)
class ProcStat:
    status: str  # psutil.STATUS_*
    pgid: int
    create_time: float  # seconds since the epoch: tells a reused pid from the original


def proc_stat(pid: int) -> ProcStat | None:
    """The process's status, group and creation time; None when there is no such process."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            return ProcStat(status=process.status(), pgid=os.getpgid(pid), create_time=process.create_time())
    except (psutil.Error, OSError):  # gone (NoSuchProcess, ProcessLookupError) or not ours to read
        return None


def pid_alive(pid: int, create_time: float | None = None) -> bool:
    """True while `pid` runs and is not a zombie; with `create_time`, only if it is still the
    same process (not a reused pid)."""
    stat = proc_stat(pid)
    if stat is None or stat.status in _DEAD:
        return False
    return create_time is None or stat.create_time == create_time


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    members = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
        except OSError:  # gone since psutil listed it
            continue
        stat = proc_stat(pid)
        if stat is not None and stat.status not in _DEAD:
            members.append(pid)
    return members


# A local "machine" (a vLLM replica, a shard store) shares the host's CPUs with the control
# plane, which in production has machines of its own. vLLM's CPU workers keep every core busy;
# at equal priority they starved the LB's event loop on a 2-core host for a second and more at
# a time (a stream then reached the LB as one burst of all its tokens). Niced, the machines get
# whatever CPU the control plane leaves them.
MACHINE_NICE = 10


def lower_machine_priority(pid: int) -> None:
    """Run the session led by `pid` (started with start_new_session) at MACHINE_NICE, best effort.

    Both knobs are needed: with the kernel's autogroup scheduling (the default on desktop and
    many server kernels) a session's CPU share is set by its autogroup's nice, and the process
    nice only ranks threads within the session. Children inherit both. Called right after
    Popen (the child has set up its session and exec'd, and Python takes far longer to start
    than this takes): a preexec_fn would run between fork and exec, unsafe in the threaded
    daemon.
    """
    try:
        os.setpriority(os.PRIO_PGRP, pid, MACHINE_NICE)
    except OSError:  # gone already, or a platform without process groups
        pass
    _set_autogroup_nice(pid)


# Without CAP_SYS_ADMIN the kernel takes one autogroup nice write per 100 ms, host-wide, and
# answers EAGAIN to the rest (sched_autogroup_write: "a heavy operation, taking global locks").
# A fleet launched in one tick would get only its first machine niced; retrying spans a few
# such windows.
_AUTOGROUP_TRIES = 5
_AUTOGROUP_RETRY_S = 0.11


def _set_autogroup_nice(pid: int) -> None:
    for attempt in range(_AUTOGROUP_TRIES):
        try:
            Path(f"/proc/{pid}/autogroup").write_text(str(MACHINE_NICE))
            return
        except BlockingIOError:  # EAGAIN: another write had the window
            if attempt + 1 < _AUTOGROUP_TRIES:
                time.sleep(_AUTOGROUP_RETRY_S)
        except OSError:  # no autogroup scheduling on this kernel (nothing to do), gone, or not ours
            return
