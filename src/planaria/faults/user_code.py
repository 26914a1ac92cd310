"""Whose fault is an exception raised inside the user's code: the user's, or the machine's?

A bug in the user's model, loss or dataset is never retried (it would fail
again): it stops the job with its traceback. But much of what surfaces inside
user code is the host's or the device's fault: a CUDA error, an out-of-memory,
an ECC error, an ``OSError`` or a timeout from a network file system or an
object store, an error of Ray's own machinery. Those are the worker's faults:
the policy replaces the worker and the job goes on (bounded by the failure
budget, so a fault that follows the job everywhere still ends it).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from planaria.faults.errors import Failure, InfrastructureError, StepAborted, UserCodeError

__all__ = ["is_infrastructure_error", "is_out_of_memory", "user_call"]

T = TypeVar("T")

# Text of errors that the device or its driver raise (torch wraps most in RuntimeError).
_DEVICE_PHRASES = (
    "cuda error",
    "cuda out of memory",
    "out of memory",
    "cublas_status",
    "cudnn_status_internal_error",
    "cudnn_status_execution_failed",
    "ecc error",
    "uncorrectable ecc",
    "an illegal memory access",
    "nccl error",
    "unspecified launch failure",
    "device not ready",
)


def is_out_of_memory(err: BaseException | str) -> bool:
    """True if ``err`` (an exception, or a failure's message or signature) is a device's or
    the host's out-of-memory."""
    if isinstance(err, MemoryError):
        return True
    oom = getattr(__import__("torch"), "OutOfMemoryError", None)
    if oom is not None and isinstance(err, oom):
        return True
    text = (err if isinstance(err, str) else f"{type(err).__name__}: {err}").lower()
    return "out of memory" in text or "outofmemoryerror" in text or "memoryerror" in text


def is_infrastructure_error(err: BaseException) -> bool:
    """True if ``err``, raised under user code, is the host's or device's fault, not a bug."""
    if isinstance(err, (MemoryError, OSError, TimeoutError, ConnectionError)):
        return True  # OSError covers storage and network file systems (and PermissionError)
    oom = getattr(__import__("torch"), "OutOfMemoryError", None)
    if oom is not None and isinstance(err, oom):
        return True
    try:
        from ray.exceptions import RaySystemError

        if isinstance(err, RaySystemError):
            return True
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    if isinstance(err, RuntimeError):
        text = str(err).lower()
        return any(p in text for p in _DEVICE_PHRASES)
    return False


def user_call(what: str, fn: Callable[..., T], *args: Any) -> T:
    """Runs user code; its exceptions come out classified, with the original traceback.
    planaria's own errors raised under it pass as they are: a step abandoned because a peer
    failed (``StepAborted``, from an overlapped reduction's hook inside ``backward``) is
    not the user's code failing."""
    try:
        return fn(*args)
    except (StepAborted, Failure):  # a control signal, or a failure already classified
        raise
    except Exception as err:
        cls = InfrastructureError if is_infrastructure_error(err) else UserCodeError
        raise cls(
            f"{what} raised {type(err).__name__}: {err}", remote_traceback=traceback.format_exc()
        ) from err
