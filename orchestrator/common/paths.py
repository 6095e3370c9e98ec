"""Where the control plane keeps its files: state database, token, logs, model cache.

One setting moves all of it: SPOT_ORCHESTRATOR_HOME (default ~/.local/state/spot-orchestrator,
or $XDG_STATE_HOME/spot-orchestrator). Tests point it at a temporary folder. It holds secrets
(tokens, KV secrets, identity keys) and logs that may quote requests: the folder is kept 0700, and
the first call of `home()` in a process sets its umask to 077, so that every file the process
creates from then on (the database, logs, records) is 0600 and every folder 0700.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
_private = False


def _private_files() -> None:
    global _private
    if not _private:
        os.umask(os.umask(0o077) | 0o077)
        _private = True


def home() -> Path:
    explicit = os.environ.get("SPOT_ORCHESTRATOR_HOME")
    if explicit:
        path = Path(explicit)
    else:
        base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
        path = base / "spot-orchestrator"
    _private_files()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        if path.stat().st_mode & 0o077:  # made by an older version, or by hand
            path.chmod(0o700)
    except OSError:  # not ours to change: it is still where the state lives
        pass
    return path


def logs_dir() -> Path:
    path = home() / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    path = Path(os.environ.get("SPOT_ORCHESTRATOR_MODELS") or home() / "models")
    path.mkdir(parents=True, exist_ok=True)
    return path


def replica_python() -> Path:
    """The replica runtime's interpreter (vLLM + agent); the local cloud runs replicas with it."""
    explicit = os.environ.get("SPOT_ORCHESTRATOR_REPLICA_PYTHON")
    return Path(explicit) if explicit else REPO_ROOT / ".venv-replica" / "bin" / "python"


def traces_dir() -> Path:
    """The shared spot traces (tests and benchmarks skip when absent)."""
    explicit = os.environ.get("SPOT_TRACES_DIR")
    return Path(explicit) if explicit else REPO_ROOT.parent / "shared" / "traces"
