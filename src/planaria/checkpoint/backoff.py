"""Retrying storage operations with backoff; what counts as a storage error."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from planaria.backoff import retry
from planaria.faults.errors import CheckpointError, StorageError

__all__ = ["is_storage_error", "with_retries"]

T = TypeVar("T")
_log = logging.getLogger("planaria.checkpoint")
# Object-store clients whose errors are not OSError (botocore's ClientError and kin).
_CLIENT_MODULES = ("botocore", "aiobotocore", "s3fs", "gcsfs", "google", "azure", "adlfs",
                   "fsspec", "aiohttp")


def is_storage_error(err: BaseException) -> bool:
    """True for errors of the storage itself: OSError (permissions, I/O, timeouts,
    connections) and the errors of object-store clients. Never a CheckpointError."""
    if isinstance(err, (CheckpointError, StorageError)):
        return False
    if isinstance(err, OSError):
        return True
    return type(err).__module__.split(".", 1)[0] in _CLIENT_MODULES


def with_retries(
    fn: Callable[[], T],
    *,
    what: str,
    attempts: int = 3,
    backoff_s: float = 0.5,
    max_backoff_s: float = 8.0,
) -> T:
    """Calls ``fn``; retries it on a storage error up to ``attempts`` times in all, waiting
    ``backoff_s``, then twice that, and so on (at most ``max_backoff_s``). Raises
    :class:`StorageError` (chained) when the last attempt fails; other errors at once."""
    try:
        return retry(fn, what=what, attempts=attempts, retryable=is_storage_error,
                     backoff_s=backoff_s, max_backoff_s=max_backoff_s, log=_log)
    except Exception as err:
        if not is_storage_error(err):
            raise
        raise StorageError(f"{what} failed {attempts} times, last: "
                           f"{type(err).__name__}: {err}") from err
