"""Retrying with exponential backoff: the one loop planaria retries in (storage operations,
a checkpoint's reads, the local Ray node's start)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["retry"]

T = TypeVar("T")


def retry(
    fn: Callable[[], T],
    *,
    what: str,
    attempts: int,
    retryable: Callable[[BaseException], bool],
    backoff_s: float = 0.5,
    max_backoff_s: float = 8.0,
    log: logging.Logger | None = None,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Calls ``fn`` up to ``attempts`` times in all while it raises an error ``retryable``
    accepts, waiting ``backoff_s``, then twice that, and so on (at most ``max_backoff_s``),
    and logging each retry (``what`` names the operation); ``on_retry(err)`` runs before
    each wait (cleanup). The last attempt's error, or any error ``retryable`` refuses, is
    raised as it is."""
    delay = backoff_s
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as err:
            if attempt == attempts or not retryable(err):
                raise
            (log or logging.getLogger("planaria")).warning(
                "%s failed (%s: %s); retry %d of %d in %.1f s", what, type(err).__name__,
                str(err)[:300], attempt, attempts - 1, delay)
            if on_retry is not None:
                on_retry(err)
            time.sleep(delay)  # backoff before a retry, not a wait for another thread
            delay = min(max_backoff_s, delay * 2)
    raise AssertionError("unreachable: attempts must be >= 1")
