"""orchestrator.common.procs with real processes: a zombie or a reused pid is not alive."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from orchestrator.common import procs
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parents[2]
_WITH_REPO = {**os.environ, "PYTHONPATH": str(REPO)}  # for a Python started outside this venv

needs_autogroup = pytest.mark.skipif(not Path("/proc/self").exists(), reason="autogroups live in Linux /proc")


def test_running_child_is_alive_and_its_zombie_is_not():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        stat = procs.proc_stat(child.pid)
        assert stat is not None and procs.pid_alive(child.pid) and procs.pid_alive(child.pid, stat.create_time)
        assert not procs.pid_alive(child.pid, stat.create_time + 1)  # same pid, another process
        child.stdin.close()  # it exits; unreaped, it stays a zombie
        wait_for(lambda: procs.proc_stat(child.pid).status == psutil.STATUS_ZOMBIE, 30, "the child to become a zombie",
                 0.05)
        os.kill(child.pid, 0)  # a zombie still answers a signal ...
        assert not procs.pid_alive(child.pid)  # ... but is not alive
    finally:
        child.kill()
        child.wait()
    assert not procs.pid_alive(child.pid) and procs.proc_stat(child.pid) is None


def test_group_members_are_the_live_processes_of_a_group():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        assert procs.group_members(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert procs.group_members(child.pid) == []


def _autogroup(pid: int) -> tuple[str, str] | None:
    """(name, nice) of a process's autogroup; None without autogroup scheduling.

    The kernel prints nothing for a process in the init session's default group (CI runs the
    tests there), which is the root task group, not an autogroup of its own."""
    path = Path(f"/proc/{pid}/autogroup")
    if not path.exists():
        return None
    fields = path.read_text().split()  # "/autogroup-5630 nice 0"
    return (fields[0], fields[-1]) if fields else ("root", "0")


@needs_autogroup
def test_a_local_machine_runs_niced_in_its_own_autogroup():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        procs.lower_machine_priority(child.pid)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == procs.MACHINE_NICE
        child_group = _autogroup(child.pid)
        if child_group is not None:  # a kernel with autogroup scheduling: the session's share is what counts
            name, nice = child_group
            assert nice == str(procs.MACHINE_NICE)
            assert name != _autogroup(os.getpid())[0]  # its own group, not the caller's
        assert os.getpriority(os.PRIO_PROCESS, os.getpid()) != procs.MACHINE_NICE  # not the caller's
    finally:
        child.kill()
        child.wait()
    procs.lower_machine_priority(child.pid)  # gone: no error


# Launches three sessions back to back and nices them; prints each one's autogroup nice.
_QUICK_LAUNCH = """
import subprocess, sys, time
from pathlib import Path
from orchestrator.common import procs
children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
            for _ in range(3)]
try:
    time.sleep(0.3)  # each has set up its session
    for child in children:
        procs.lower_machine_priority(child.pid)
    print(" ".join(Path(f"/proc/{c.pid}/autogroup").read_text().split()[-1] for c in children))
finally:
    for child in children:
        child.kill()
"""


def _unprivileged_python() -> list[str]:
    """A command that runs Python as `nobody`, where this process may switch to it and some
    Python (with orchestrator.common.procs and psutil) is open to that
    user; else this process's own Python, as its own user.

    Only an unprivileged caller meets the kernel's limit of one autogroup write per 100 ms."""
    if os.geteuid() == 0 and shutil.which("setpriv"):
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        probe = ("import subprocess, sys, orchestrator.common.procs; "
                 "subprocess.run([sys.executable, '-c', ''], check=True)")
        for python in (sys.executable, "/usr/bin/python3"):
            if subprocess.run([*as_nobody, python, "-c", probe], cwd=REPO, capture_output=True,
                              timeout=60, env=_WITH_REPO).returncode == 0:
                return [*as_nobody, python]
    return [sys.executable]


@needs_autogroup
def test_every_machine_of_a_quick_launch_gets_its_autogroup_niced():
    if _autogroup(os.getpid()) is None:
        pytest.skip("this kernel has no autogroup scheduling")
    run = subprocess.run([*_unprivileged_python(), "-c", _QUICK_LAUNCH], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env=_WITH_REPO)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(procs.MACHINE_NICE)] * 3
