"""Is a process alive: read from Linux /proc, with a portable fallback. And the CPU priority
of the local cloud's machines.

A zombie still answers `os.kill(pid, 0)`, and a pid can be reused by another process; /proc
tells both apart (its state, and its start time since boot). The CLI checks the daemon's pid
with it, the local cloud its replicas' processes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

HAVE_PROC = Path("/proc/self/stat").exists()
_DEAD_STATES = ("Z", "X")  # zombie, dead


@dataclasses.dataclass(frozen=True)
class ProcStat:
    state: str
    pgid: int
    start_time: int  # clock ticks since boot: tells a reused pid from the original


def proc_stat(pid: int) -> ProcStat | None:
    """The process's /proc/<pid>/stat, None when there is no such process (or no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone (FileNotFoundError, ProcessLookupError) or not ours to read
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may contain spaces
    return ProcStat(state=fields[0], pgid=int(fields[2]), start_time=int(fields[19]))


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """True while `pid` runs and is not a zombie; with `start_time`, only if it is still the
    same process (not a reused pid)."""
    if not HAVE_PROC:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    stat = proc_stat(pid)
    if stat is None or stat.state in _DEAD_STATES:
        return False
    return start_time is None or stat.start_time == start_time


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    if not HAVE_PROC:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat is not None and stat.pgid == pgid and stat.state not in _DEAD_STATES:
                members.append(int(entry.name))
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
