"""A sharded replica's leader: the one worker of k the controller talks to.

With ``workers_per_replica=k`` the controller starts one worker per replica, the
leader (shard index 0); the leader starts the replica's k - 1 other workers as
Ray actors it owns, so that they die with it: a replica lives, fails, drains and
is replaced as one (see :mod:`planaria.worker.sharded`). Each controller call that the
replica's workers must all make (a join, a step, a run, a state transfer) goes
to the others first and runs on the leader meanwhile (:func:`fans_out`); their
answers are merged into one, so the controller's protocol is the same at any k.

A worker of the replica that dies makes the leader's call fail as the replica's
loss (``WorkerLost`` naming the leader: the controller evicts the replica and
its owned workers go with it); one that hangs stalls the leader inside the
replica's collectives, which the controller's hang detection finds on the leader.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar, cast

import ray

from planaria.faults.errors import (
    Failure,
    InfrastructureError,
    InternalError,
    StepAborted,
    UserCodeError,
    WorkerLost,
    is_death,
)
from planaria.wire import store_keys

__all__ = ["FOLLOWER_SETTLE_S", "fans_out", "lane", "replica_failed", "start_followers"]

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")

FOLLOWER_SETTLE_S = 10.0
"""After the leader's own part of a call failed, how long it waits for the others' parts
to end (theirs fail too, at once, when a worker of the replica died) to tell a death in
the replica from another replica's failure."""


def lane(group: str) -> Callable[[F], F]:
    """``ray.method(concurrency_group=group)``, typed as what it is to the method's body.
    Put it under :func:`fans_out`: Ray reads a method's lane from the function it wraps."""
    return cast(Callable[[F], F], ray.method(concurrency_group=group))


def fans_out(merge: Callable[[R, list[R]], R] | None = None) -> Callable[[F], F]:
    """Runs a worker method on the replica's other workers too, and merges the answers
    (``merge(leader's, [others' in shard order])``, e.g. a report's own ``merge``, see
    :mod:`planaria.wire.reports`; default: the leader's)."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            followers = getattr(self, "followers", None)
            if not followers:
                return fn(self, *args, **kwargs)
            refs = [getattr(f, fn.__name__).remote(*args, **kwargs) for f in followers]
            try:
                mine = fn(self, *args, **kwargs)
            except BaseException as err:
                _raise_replica_error(self, refs, err)
                raise
            theirs = _gather(self, refs)
            return merge(mine, theirs) if merge is not None else mine

        return call  # type: ignore[return-value]

    return decorate


def start_followers(cls: type, groups: dict[str, int], name: str, k: int, spec_blob: bytes,
                    options: dict[str, Any] | None, *args: Any, **kwargs: Any) -> list[Any]:
    """The leader ``name`` starts its replica's workers 1 .. k-1 as Ray actors of the worker
    class ``cls`` (with its concurrency ``groups``), which it owns: they die with it.
    ``spec_blob``: the spec as the controller pickled it (its functions may live in a module
    only the controller has, a script run by `planaria run`, pickled by value there);
    ``args``/``kwargs``: the worker's other arguments, each follower's ``shard_index`` added."""
    remote: Any = ray.remote
    actor = remote(concurrency_groups=groups)(cls)
    return [actor.options(max_restarts=0, max_concurrency=1, **(options or {})).remote(
                f"{name}.{i}", spec_blob, *args, shard_index=i, **kwargs)
            for i in range(1, k)]


def replica_failed(store: Any, replica_key: str, index: int, err: Failure) -> None:
    """A worker of a sharded replica other than the leader failed on its own during a step
    (an error in the user's code, out of memory): the replica's other workers may already
    wait for it in FSDP's collectives, which only its exit ends. It leaves its error for the
    leader to report, and exits."""
    record = {"type": type(err).__name__, "message": str(err.args[0]) if err.args else "",
              "traceback": getattr(err, "remote_traceback", None)}
    with contextlib.suppress(Exception):
        store.set(store_keys.replica_failed(replica_key, index), json.dumps(record))
    logging.getLogger("planaria.worker.replica").error("%s", record["message"])
    os._exit(1)


def _dead(worker: Any, index: int, err: BaseException) -> Failure:
    """The replica's loss when worker ``index`` died, or the error it left (replica_failed)."""
    name = worker.name
    key = store_keys.replica_failed(worker.replica_key, index)
    with contextlib.suppress(Exception):
        if worker.store.check([key]):
            record = json.loads(worker.store.get(key))
            cls = {c.__name__: c for c in (UserCodeError, InfrastructureError)}.get(
                record["type"], InternalError)
            return cls(record["message"], remote_traceback=record["traceback"],
                       workers=(name,))
    return WorkerLost(f"worker {name}.{index} of replica {name} died: {str(err)[:300]}",
                      workers=(name,))


def _gather(worker: Any, refs: list[Any]) -> list[Any]:
    """The other workers' answers; a death among them is the replica's loss."""
    name = worker.name
    out = []
    first_error: BaseException | None = None
    for i, ref in enumerate(refs, start=1):
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayTaskError as err:
            cause = err.cause if isinstance(err.cause, BaseException) else err
            if isinstance(cause, Failure) and cause.workers:
                cause.workers = (name,)  # the controller knows the replica by its leader
            first_error = first_error or cause
            out.append(None)
        except Exception as err:
            if not is_death(err):
                raise
            raise _dead(worker, i, err) from None
    if first_error is not None:
        raise first_error
    return out


def _raise_replica_error(worker: Any, refs: list[Any], err: BaseException) -> None:
    """The leader's part failed: if one of the others died, the replica is lost (the
    leader's error, a broken collective inside the replica, is its consequence). An error
    of the leader's own (its user code) is reported at once."""
    if isinstance(err, Failure) and not isinstance(err, StepAborted):
        return
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=FOLLOWER_SETTLE_S)
    for i, ref in enumerate(refs, start=1):
        if ref not in done:
            continue
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError as failed:
            cause = failed.cause
            if isinstance(cause, Failure):  # another worker's own failure (it could not load
                cause.workers = (worker.name,)  # its samples): the replica's, named by it
                raise cause from err
        except Exception as other:
            if is_death(other):
                raise _dead(worker, i, other) from err
