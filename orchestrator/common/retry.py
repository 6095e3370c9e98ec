"""The one retry/backoff helper of the project (control plane and replica side alike).

Stdlib only, so the replica runtime can import it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def backoff_delays(base: float = 0.5, factor: float = 2.0, cap: float = 30.0, jitter: float = 0.2):
    """An endless sequence of exponentially growing, jittered delays (seconds)."""
    delay = base
    while True:
        yield delay * (1 + random.uniform(-jitter, jitter))
        delay = min(cap, delay * factor)


def retry(
    fn: Callable[[], T],
    *,
    retry_on: tuple[type[BaseException], ...],
    attempts: int = 5,
    base: float = 0.5,
    cap: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """Call fn until it succeeds, retrying the given exception types with backoff.

    The last error is re-raised once `attempts` calls have failed.
    """
    delays = backoff_delays(base=base, cap=cap)
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except retry_on as err:
            if attempt == attempts:
                raise
            delay = next(delays)
            if on_retry is not None:
                on_retry(attempt, err, delay)
            sleep(delay)
    raise AssertionError("unreachable")
