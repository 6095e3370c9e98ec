"""A throwaway PostgreSQL server for the tests that need a real one (the `postgres_server`
fixture in tests/control/conftest.py starts it), and a fresh database on it per test."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import free_port


def postgres_bin() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return candidates[-1].parent if candidates else None


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """A server's SQLAlchemy URL (SPOT_ORCHESTRATOR_TEST_PG_URL's, else one started in a temporary
    folder and stopped after). Skips without psycopg or the server binaries; fails instead when
    SPOT_ORCHESTRATOR_REQUIRE_PG is set (CI: these tests must run)."""
    explicit = os.environ.get("SPOT_ORCHESTRATOR_TEST_PG_URL")
    if explicit:
        yield explicit
        return
    pytest.importorskip("psycopg", reason="the PostgreSQL driver (psycopg) is not installed")
    bindir = postgres_bin()
    if bindir is None:
        if os.environ.get("SPOT_ORCHESTRATOR_REQUIRE_PG"):
            pytest.fail("PostgreSQL server binaries (initdb, postgres) not found")
        pytest.skip("PostgreSQL server binaries (initdb, postgres) not found")
    root = Path(tempfile.mkdtemp(prefix="spot-pg-"))
    user = None
    if os.geteuid() == 0:  # postgres refuses to run as root
        user = "nobody"
        os.chown(root, pwd.getpwnam(user).pw_uid, -1)
    subprocess.run(
        [bindir / "initdb", "-D", root / "data", "-A", "trust", "-U", "postgres"],
        user=user, check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    port = free_port()
    with open(root / "server.log", "wb") as log:
        server = subprocess.Popen(
            [bindir / "postgres", "-D", root / "data", "-p", str(port), "-k", root,
             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
            user=user, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        import psycopg

        deadline = time.monotonic() + 120
        while True:
            try:
                psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"PostgreSQL did not start: {(root / 'server.log').read_text()[-500:]}")
                time.sleep(0.2)
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(root, ignore_errors=True)


def fresh_db(server_url: str) -> str:
    """A new, empty database on the server; its URL."""
    import psycopg

    name = f"t{uuid.uuid4().hex[:12]}"
    plain = server_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server_url.rsplit("/", 1)[0] + f"/{name}"
