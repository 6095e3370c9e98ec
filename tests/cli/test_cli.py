"""The CLI as a user meets it: bad input is one line on stderr and exit code 2, never a
traceback; commands that need the daemon say how to start it."""

from __future__ import annotations

import pytest

from tests.helpers import spotctl

BAD_SPECS = {
    "replicas_type": ("name: x\nservice:\n  replicas: two\nengine:\n  model: tiny\n", "service.replicas"),
    "typo": ("name: x\nservice:\n  replica_polcy: {min_replicas: 1}\nengine:\n  model: tiny\n", "replica_policy"),
    "min_gt_max": (
        "name: x\nservice:\n  replica_policy: {min_replicas: 3, max_replicas: 2}\nengine:\n  model: tiny\n",
        "min_replicas",
    ),
    "no_model": ("name: x\nservice:\n  replicas: 1\n", "engine"),
    "bad_yaml": ("name: x\nservice: [\n", "line"),
    "failure_domain": ("name: x\nengine: {model: tiny}\nkv: {failure_domain: rack}\n",
                       "kv.failure_domain: expected one of zone, region, cloud, got 'rack'"),
    "failure_domain_unreachable": (
        "name: x\nengine: {model: tiny}\nkv: {failure_domain: cloud}\nresources: {cloud: local}\n",
        "kv.failure_domain: 'cloud' needs replicas in at least 3 clouds for k=4, m=2, but resources allow only local",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_up_with_a_bad_spec_is_one_line_and_exit_2(tmp_path, state_home, case):
    text, expected = BAD_SPECS[case]
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    proc = spotctl("up", str(spec), check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    # Validation happens before anything starts: no daemon was launched for a bad spec.
    assert not (state_home / "daemon.json").exists()


def test_missing_file_and_no_daemon_are_one_line_errors(tmp_path, state_home):
    proc = spotctl("up", str(tmp_path / "nope.yaml"), check=False, timeout=120)
    assert proc.returncode == 2 and "nope.yaml" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    # No daemon: every verb starts one. One that cannot start (its port is taken) is a runtime
    # failure: one line, exit 1.
    import os
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", int(os.environ["SPOT_ORCHESTRATOR_DAEMON_PORT"])))
        taken.listen()
        proc = spotctl("status", check=False, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_bad_arguments_exit_2(state_home):
    proc = spotctl("chaos", "preempt", check=False, timeout=120)
    assert proc.returncode == 2 and "exactly one" in proc.stderr
    proc = spotctl("status", "--no-such-flag", check=False, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: No such option: --no-such-flag (see `spotctl status --help`)"]
