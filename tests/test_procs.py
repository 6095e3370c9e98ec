"""orchestrator.procs with real processes: a zombie or a reused pid is not alive."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import procs
from tests.helpers import wait_for

pytestmark = pytest.mark.skipif(not procs.HAVE_PROC, reason="needs Linux /proc")


def test_running_child_is_alive_and_its_zombie_is_not():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        stat = procs.proc_stat(child.pid)
        assert stat is not None and procs.pid_alive(child.pid) and procs.pid_alive(child.pid, stat.start_time)
        assert not procs.pid_alive(child.pid, stat.start_time + 1)  # same pid, another process
        child.stdin.close()  # it exits; unreaped, it stays a zombie
        wait_for(lambda: procs.proc_stat(child.pid).state == "Z", 30, "the child to become a zombie", 0.05)
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


def test_a_local_machine_runs_niced_in_its_own_autogroup():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        procs.lower_machine_priority(child.pid)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == procs.MACHINE_NICE
        autogroup = Path(f"/proc/{child.pid}/autogroup")
        if autogroup.exists():  # a kernel with autogroup scheduling: the session's share is what counts
            assert autogroup.read_text().split()[-1] == str(procs.MACHINE_NICE)
            assert autogroup.read_text().split()[0] != Path("/proc/self/autogroup").read_text().split()[0]
        assert os.getpriority(os.PRIO_PROCESS, os.getpid()) != procs.MACHINE_NICE  # not the caller's
    finally:
        child.kill()
        child.wait()
    procs.lower_machine_priority(child.pid)  # gone: no error
