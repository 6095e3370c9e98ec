"""Is a process alive: read from Linux /proc, with a portable fallback.

A zombie still answers `os.kill(pid, 0)`, and a pid can be reused by another process; /proc
tells both apart (its state, and its start time since boot). The CLI checks the daemon's pid
with it, the local cloud its replicas' processes.
"""

from __future__ import annotations

import dataclasses
import os
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
