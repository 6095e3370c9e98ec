"""Fixtures of the load balancer's tests."""

from __future__ import annotations

import pytest

from tests.fakes.upstream import FakeProcess


@pytest.fixture(scope="module")
def fakes():
    """Two fake vLLM upstream processes, `a` and `b` (their system_fingerprint says which),
    shared by one test module."""
    fakes = []
    try:
        fakes += [FakeProcess("a"), FakeProcess("b")]
        yield tuple(fakes)
    finally:
        for fake in fakes:
            fake.stop()
