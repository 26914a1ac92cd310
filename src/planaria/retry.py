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

The saving rules are ``fit``'s: a user-code error (a :class:`UserCodeError` from the
workers, or any exception of ``fn``'s own code) stops the job after saving what is safe:
the save in flight is finished, then the committed state is saved (with checkpoints on),
and the error is raised. Differences from pathways-utils' ``elastic_retry`` are in
docs/design.md ("elastic_retry").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from planaria.control.job import Job
from planaria.faults.errors import ElasticRuntimeError, Failure, PlanariaError, UserCodeError

__all__ = ["elastic_retry"]

R = TypeVar("R")
_log = logging.getLogger("planaria.faults.user_code")


def elastic_retry(
    job: Job,
    *,
    max_retries: int = 10,
    on_retry: Callable[[int, Failure], None] | None = None,
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorates ``fn(job, *args, **kwargs)`` so that failures are recovered and ``fn`` re-run.

    A user's own bug (:class:`~planaria.faults.errors.UserCodeError`, or an exception ``fn``
    raises itself) is never retried: what is safe is saved first, as ``fit`` does
    (the committed state, with checkpoints on), then it is raised. After
    ``max_retries`` retries, or when the policy gives up,
    :class:`~planaria.faults.errors.ElasticRuntimeError` is raised, chained to the last
    failure. ``on_retry(attempt, failure)`` runs before each new call.
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
                except UserCodeError as failure:
                    job.recovery.handle(failure)  # saves what is safe, then raises it
                    raise  # not reached
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
                except Exception as err:
                    if isinstance(err, PlanariaError):
                        raise  # planaria's own verdict (the policy gave up, a config error)
                    _stop_for_own_code(job, fn, err)
                    raise

        return wrapper

    return decorate


def _stop_for_own_code(job: Job, fn: Callable[..., Any], err: Exception) -> None:
    """``fn``'s own code raised (between the job's calls, so the job is consistent): the
    job stops as for a user-code error in a worker, saving what is safe; the caller
    raises ``err`` itself."""
    failure = UserCodeError(f"{fn.__name__} raised {type(err).__name__}: {err}",
                            step=job.steps_done)
    try:
        job.recovery.handle(failure)
    except UserCodeError:
        pass
    except Exception:
        _log.exception("could not save before stopping for %s's error", fn.__name__)
