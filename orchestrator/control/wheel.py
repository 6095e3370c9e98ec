"""The daemon's own wheel, which VMs install so that a replica runs exactly its daemon's code.

Built once per daemon process into `<state>/wheels/`: from the source tree when the daemon runs
from a checkout (pip wheel, no dependencies, no build isolation), else repacked from the
installed distribution's files (its RECORD). Served on the API's /v1/bootstrap/wheel route.
"""

from __future__ import annotations

import base64
import csv
import functools
import hashlib
import io
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from orchestrator.common import paths
from orchestrator.common.errors import UserError

DISTRIBUTION = "spot-orchestrator"


def version() -> str:
    return metadata.version(DISTRIBUTION)


def own_wheel() -> Path:
    """The path of this daemon's wheel; raises UserError when it cannot be built."""
    path = _own_wheel(paths.home())
    return path if path.exists() else _rebuilt(paths.home())


def _rebuilt(home: Path) -> Path:
    _own_wheel.cache_clear()
    return _own_wheel(home)


@functools.lru_cache(maxsize=4)
def _own_wheel(home: Path) -> Path:
    out = home / "wheels"
    shutil.rmtree(out, ignore_errors=True)  # a wheel of an earlier daemon is not this one
    out.mkdir(parents=True)
    source = paths.REPO_ROOT
    if (source / "pyproject.toml").exists():
        return _build_from_source(source, out)
    return _repack_installed(out)


def _build_from_source(source: Path, out: Path) -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    wheels = sorted(out.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"building the replica wheel from {source} failed: {last[0]}")
    return wheels[0]


def _repack_installed(out: Path) -> Path:
    """A wheel of the installed files: RECORD lists them relative to site-packages."""
    dist = metadata.distribution(DISTRIBUTION)
    name = f"{DISTRIBUTION.replace('-', '_')}-{dist.version}-py3-none-any.whl"
    path = out / name
    record_rows = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        record_name = None
        for file in dist.files or ():
            if file.suffix == ".pyc" or "__pycache__" in file.parts:
                continue
            if file.name == "RECORD":
                record_name = str(file)
                continue
            data = Path(dist.locate_file(file)).read_bytes()
            zf.writestr(str(file), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record_rows.append([str(file), f"sha256={digest}", str(len(data))])
        if record_name is None:
            raise UserError(f"the installed {DISTRIBUTION} has no RECORD; reinstall it with pip")
        buf = io.StringIO()
        csv.writer(buf).writerows([*record_rows, [record_name, "", ""]])
        zf.writestr(record_name, buf.getvalue())
    return path
