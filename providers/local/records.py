"""The local cloud's state on disk: one JSON file per instance, plus zones and capacity.

Every read-modify-write happens under one exclusive file lock shared by all processes, so a
restarted daemon, or a CLI process beside it (`spotctl chaos`), sees the same cloud.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Records:
    """The local cloud's state: one JSON file per instance plus zones and capacity, all
    read-modify-written under one exclusive file lock (shared by every process)."""

    def __init__(self, root: Path):
        self.root = root
        self.instances_dir = root / "instances"
        self.instances_dir.mkdir(parents=True, exist_ok=True)
        self.notices_dir = root / "notices"  # what each replica sees (its local "IMDS")
        self.notices_dir.mkdir(exist_ok=True)
        self._lock_path = root / "lock"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        # A fresh open file description per call, so threads of one process exclude each
        # other too. Not reentrant: never nest.
        with open(self._lock_path, "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def write_path(self, path: Path, data: Any) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: a reader never sees half a file

    def read_json(self, name: str, default: Any) -> Any:
        try:
            return json.loads((self.root / name).read_text())
        except (FileNotFoundError, ValueError):
            return default

    def write_json(self, name: str, data: Any) -> None:
        self.write_path(self.root / name, data)

    def instance(self, instance_id: str) -> dict[str, Any] | None:
        if "/" in instance_id or not instance_id:
            return None
        try:
            return json.loads((self.instances_dir / f"{instance_id}.json").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def instances(self) -> builtins.list[dict[str, Any]]:
        out = []
        for path in sorted(self.instances_dir.glob("*.json")):
            with contextlib.suppress(FileNotFoundError, ValueError):
                out.append(json.loads(path.read_text()))
        return out

    def save(self, record: dict[str, Any]) -> None:
        self.write_path(self.instances_dir / f"{record['instance_id']}.json", record)

    def remove(self, instance_id: str) -> None:
        for path in (self.instances_dir / f"{instance_id}.json", self.notice_file(instance_id)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    # A launch in progress: marked before its process starts, cleared once its record is saved.
    # Launches hold the lock throughout, so a marker another lock holder sees is a launcher
    # killed in between, and its process (if it started) has no record: nobody's.
    def begin_launch(self, instance_id: str) -> None:
        (self.instances_dir / f"{instance_id}.launching").touch()

    def end_launch(self, instance_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.instances_dir / f"{instance_id}.launching").unlink()

    def interrupted_launches(self) -> builtins.list[str]:
        return [p.name.removesuffix(".launching") for p in self.instances_dir.glob("*.launching")]

    def notice_file(self, instance_id: str) -> Path:
        return self.notices_dir / f"{instance_id}.json"
