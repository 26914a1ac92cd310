"""``elastic_retry``: the same recovery machinery for users who write their own loop.

This is the form Google's MaxText uses on Pathways: the training function is
wrapped; when a failure the policy accepts escapes it, the job cleans up the
partial state (drops the failed step, evicts dead workers, rebuilds the process
group or restores the latest checkpoint) and the function is called again, in
the same process, with the job's state intact::

    job = planaria.Job(spec, planaria.RunConfig(steps=100, replicas=3, run_dir="runs/x"))

    @planaria.elastic_retry(job, max_retries=5)
    def train(job):
        while job.steps_done < 100:
            job.train_step()

    with job:
        train()
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from planaria.controller import Job
from planaria.errors import ElasticRuntimeError, Failure, UserCodeError

__all__ = ["elastic_retry"]

R = TypeVar("R")
_log = logging.getLogger("planaria.faults")


def elastic_retry(
    job: Job,
    *,
    max_retries: int = 10,
    on_retry: Callable[[int, Failure], None] | None = None,
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorates ``fn(job, *args, **kwargs)`` so that failures are recovered and ``fn`` re-run.

    A user's own bug (:class:`~planaria.errors.UserCodeError`) is raised at
    once, never retried. After ``max_retries`` retries, or when the policy gives
    up, :class:`~planaria.errors.ElasticRuntimeError` is raised, chained to the
    last failure. ``on_retry(attempt, failure)`` runs before each new call.
    """
    if max_retries < 0:
        raise ValueError(f"max_retries={max_retries} is not valid: an integer >= 0")

    def decorate(fn: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> R:
            if not job.started:
                job.start()
            attempt = 0
            while True:
                try:
                    return fn(job, *args, **kwargs)
                except UserCodeError:
                    raise
                except Failure as failure:
                    attempt += 1
                    if attempt > max_retries:
                        raise ElasticRuntimeError(
                            f"{fn.__name__} failed {attempt} times; max_retries={max_retries}"
                        ) from failure
                    job.recovery.handle(failure)
                    _log.warning(
                        "retrying %s (attempt %d) after %s", fn.__name__, attempt, failure.kind
                    )
                    if on_retry is not None:
                        on_retry(attempt, failure)

        return wrapper

    return decorate
