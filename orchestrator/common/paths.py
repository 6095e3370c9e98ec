"""Where the control plane keeps its files: state database, token, logs, model cache.

One setting moves all of it: SPOT_ORCHESTRATOR_HOME (default ~/.local/state/spot-orchestrator,
or $XDG_STATE_HOME/spot-orchestrator). Tests point it at a temporary folder.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def home() -> Path:
    explicit = os.environ.get("SPOT_ORCHESTRATOR_HOME")
    if explicit:
        path = Path(explicit)
    else:
        base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
        path = base / "spot-orchestrator"
    path.mkdir(parents=True, exist_ok=True)
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
