"""Fixtures of the control-plane tests."""

from __future__ import annotations

import pytest

from tests.fakes import postgres


@pytest.fixture(scope="session")
def postgres_server():
    """One throwaway PostgreSQL server for the run (tests/fakes/postgres); each test makes its own
    database on it (postgres.fresh_db)."""
    with postgres.postgres_server() as url:
        yield url
