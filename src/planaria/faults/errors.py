"""planaria's errors: one rooted hierarchy, and the one function that classifies faults.

Failures (subclasses of :class:`Failure`) are what the recovery policy acts on.
:func:`classify` is the only place where Ray's and torch's exceptions and the
workers' reports are turned into failures.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AllReplicasLost",
    "CheckpointError",
    "ConfigError",
    "DataMismatch",
    "ElasticRuntimeError",
    "Failure",
    "FinalSaveFailed",
    "InfrastructureError",
    "InternalError",
    "NonFiniteLoss",
    "OutOfMemory",
    "PeerFailed",
    "PlanariaError",
    "Preempted",
    "RayLost",
    "ReplicaDivergence",
    "StaleGeneration",
    "StepAborted",
    "StorageError",
    "UserCodeError",
    "Work",
    "WorkFault",
    "WorkerExited",
    "WorkerHung",
    "WorkerLost",
    "WorkerUnreachable",
    "classify",
    "is_consequence",
    "is_death",
    "signature",
]


@dataclass(frozen=True)
class Work:
    """What a worker was doing when it failed: step ``step``'s micro-batch ``micro_batch``
    (its place in the global batch), and the sample ``sample`` whose ``dataset[i]`` raised
    (None when the failure was not in a load). ``what`` names work outside the steps (a
    factory at a worker's start)."""

    step: int | None = None
    micro_batch: int | None = None
    sample: int | None = None
    what: str | None = None

    @property
    def key(self) -> tuple[Any, ...]:
        """Two failures on the same key failed on the same work: the same sample (in any
        step: a bad sample is bad in every epoch), else the same micro-batch of the same
        step, else the same named work."""
        if self.sample is not None:
            return ("sample", self.sample)
        if self.micro_batch is not None:
            return ("micro_batch", self.step, self.micro_batch)
        return ("what", self.what, self.step)

    def describe(self) -> str:
        if self.sample is not None:
            return f"sample {self.sample}" + (f" (step {self.step})" if self.step is not None
                                              else "")
        if self.micro_batch is not None:
            return f"micro-batch {self.micro_batch} of step {self.step}"
        return self.what or (f"step {self.step}" if self.step is not None else "unknown work")


_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")


def signature(err: BaseException | str) -> str:
    """How a failure reads with its numbers masked (ids, paths' digits, addresses): two
    failures with one signature failed the same way."""
    text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return _NUMBERS.sub("#", first)[:300]


class PlanariaError(Exception):
    """Root of planaria's errors."""


class ConfigError(PlanariaError, ValueError):
    """A configuration value is wrong; the message names the field, the value, what is accepted."""


class DataMismatch(ConfigError):
    """Workers built different datasets (length or content); the message names who and what.

    A replica trained on other data would poison the job: a joiner with other
    data is refused, and at start the job does not begin.
    """


class CheckpointError(PlanariaError):
    """A checkpoint is missing, torn, corrupt or malformed."""


class FinalSaveFailed(CheckpointError):
    """``fit``'s final save did not commit (the checkpoint root is full, gone, refused):
    the run is not thrown away. ``job`` is the still-open :class:`~planaria.control.job.Job`,
    its workers holding the trained state of step ``step``: save it elsewhere with
    ``err.job.save(root=...)`` (or to its root again once there is room: ``err.job.save()``),
    then close it with ``err.job.close()``, which the caller must do (it holds the workers,
    the lease and Ray). ``newest_step`` and ``newest_path`` name the newest checkpoint that
    did commit (None: none)."""

    def __init__(self, message: str, *, job: Any, step: int, newest_step: int | None,
                 newest_path: str | None) -> None:
        super().__init__(message)
        self.job = job
        self.step = step
        self.newest_step = newest_step
        self.newest_path = newest_path


class StaleGeneration(PlanariaError):
    """A call carried an older generation than the worker's: the caller is fenced off."""


class WorkerExited(PlanariaError):
    """A call's error where the worker's process ended before it answered: its lifeline to
    the controller closed (:mod:`planaria.wire.lifeline`), ahead of Ray's notice. A death,
    as Ray's ``ActorDiedError`` is (:func:`is_death`)."""


class StepAborted(PlanariaError):
    """Not an error but a control signal: a worker abandoned a step because a peer failed."""


class PeerFailed(StepAborted):
    """A survivor's run that a peer's failure ended, as the survivor answered it
    (``RunFailed``): ``settled`` is its answer to ``Worker.settle_run``."""

    def __init__(self, message: str, *, settled: Any) -> None:
        super().__init__(message)
        self.settled = settled


class ElasticRuntimeError(PlanariaError):
    """planaria gave up: the retry budget is spent or the job cannot go on. Chained to the cause."""


class RayLost(ElasticRuntimeError):
    """A process of Ray's own died under the job: its GCS, or the raylet of the
    controller's node (see :mod:`planaria.control.ray_health`). The job cannot go on without it:
    planaria saved what was safe to save and ended. ``process`` names what died
    (``"gcs_server"``, ``"raylet"``), ``pid`` its process id where it ran on the
    controller's machine (else None), ``saved`` the checkpoint the end saved (None:
    none; the newest committed one stands)."""

    def __init__(self, message: str, *, process: str, pid: int | None = None,
                 saved: str | None = None) -> None:
        super().__init__(message)
        self.process = process
        self.pid = pid
        self.saved = saved

    def __reduce__(self) -> Any:  # keep keyword fields across pickling
        return (_rebuild_ray_lost, (self.args[0], self.process, self.pid, self.saved))


def _rebuild_ray_lost(message: str, process: str, pid: int | None, saved: str | None) -> RayLost:
    return RayLost(message, process=process, pid=pid, saved=saved)


class Failure(PlanariaError):
    """A fault the recovery policy acts on. ``workers`` names the workers at fault (``w<N>``);
    ``work`` what they were doing, where known (see :class:`Work`)."""

    kind = "failure"

    def __init__(self, message: str, *, workers: tuple[str, ...] = (), step: int | None = None,
                 work: Work | None = None):
        super().__init__(message)
        self.workers = tuple(workers)
        self.step = step
        self.work = work
        self.raised: list[tuple[str, Work | None, str]] = []
        """(worker, work, signature) of every worker's raised error the step failed with."""
        self.settled: dict[str, Any] = {}
        """What the survivors whose run a peer's failure ended answered with it (a
        ``Settled`` each, by worker; see :class:`PeerFailed`)."""


class WorkerLost(Failure):
    """A worker process or its node died."""

    kind = "worker_lost"


class WorkerHung(Failure):
    """A worker stopped making progress past the step deadline (or stopped heartbeating)."""

    kind = "worker_hung"


class WorkerUnreachable(WorkerHung):
    """Every rank of a group waited on its peers past the deadline and this one could not be
    reached (its process-group link is dead though the process and its heartbeat live)."""

    kind = "worker_unreachable"


class Preempted(Failure):
    """A planned departure: the worker got a preemption notice (SIGTERM) and drains."""

    kind = "preempted"


class AllReplicasLost(Failure):
    """No live replica holds the training state; only a checkpoint can bring it back."""

    kind = "all_replicas_lost"


class NonFiniteLoss(Failure):
    """The global loss or the reduced gradient of a step was NaN or infinite."""

    kind = "nonfinite_loss"


class StorageError(Failure):
    """Checkpoint storage failed (an OSError, an object store's client error, a permission
    error) after its retries; not a bug in user code and not a worker's fault."""

    kind = "storage_error"


class ReplicaDivergence(Failure):
    """Replicas' parameters disagree after a commit (silent divergence: a bit flip, a bug).

    ``workers`` are the replicas that differ from a strict majority, or all of
    them when there is no majority; they are treated as lost.
    """

    kind = "replica_divergence"


class _WithTraceback(Failure):
    """A failure that carries the worker's original traceback text (``remote_traceback``)."""

    def __init__(
        self,
        message: str,
        *,
        remote_traceback: str = "",
        workers: tuple[str, ...] = (),
        step: int | None = None,
        work: Work | None = None,
    ):
        super().__init__(message, workers=workers, step=step, work=work)
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        base = super().__str__()
        if self.remote_traceback:
            return f"{base}\n\nOriginal traceback (in worker {', '.join(self.workers)}):\n" + (
                self.remote_traceback
            )
        return base

    def __reduce__(self) -> Any:  # keep keyword fields across Ray's pickling
        return (
            _rebuild,
            (type(self), self.args[0], self.remote_traceback, self.workers, self.step,
             self.work),
        )


def _rebuild(
    cls: type[_WithTraceback], message: str, tb: str, workers: tuple[str, ...], step: int | None,
    work: Work | None = None,
) -> _WithTraceback:
    return cls(message, remote_traceback=tb, workers=workers, step=step, work=work)


class InfrastructureError(_WithTraceback):
    """The worker's host or device failed under the user's code (CUDA error, out of memory,
    ECC, storage or network I/O): the worker is replaced, the job goes on."""

    kind = "infrastructure_error"


class InternalError(_WithTraceback):
    """planaria itself found its state inconsistent on a worker (an invariant broke, a stale
    generation): the worker is replaced and the job goes on; a bug to report, not the user's."""

    kind = "internal_error"


class UserCodeError(_WithTraceback):
    """The user's own code (model, loss, dataset, optimizer) raised; never retried.

    ``remote_traceback`` is the worker's original traceback text.
    """

    kind = "user_code_error"


class OutOfMemory(UserCodeError):
    """A worker ran out of memory (the device's or the host's) and another did again after it:
    the job's size, not a machine. Not retried a third time; the message says what to
    lower."""

    kind = "out_of_memory"


class WorkFault(UserCodeError):
    """A fault of the work, not of a worker: the same sample or micro-batch failed the same way
    on two workers (or on a replacement as on its predecessor), or hung on two. ``work``
    names it, ``workers`` the workers it failed on. The job stops with a save by default;
    ``RecoveryPolicy(on_work_fault="skip")`` skips the samples and goes on."""

    kind = "work_fault"


# Phrases in a survivor's collective error that mean "a peer went away", not a bug here.
_PEER_GONE = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "read error",
    "write error",
    "timed out",
    "timeout",
    "socket",
    "gloo",
    "nccl",
    "peer",
)


def is_peer_failure(err: BaseException) -> bool:
    """True if ``err`` is a survivor's collective error caused by another worker's failure."""
    text = str(err).lower()
    return isinstance(err, (RuntimeError, ConnectionError, OSError)) and any(
        p in text for p in _PEER_GONE
    )


def is_consequence(err: BaseException) -> bool:
    """Whether ``err`` is a consequence of another worker's failure, never a cause: the
    worker abandoned the step (StepAborted) or its collective broke on a peer that went."""
    return isinstance(err, StepAborted) or is_peer_failure(err)


def root_cause(err: BaseException) -> BaseException:
    """Unwraps Ray's task errors to the exception the worker raised."""
    try:
        from ray.exceptions import RayTaskError
    except ImportError:  # pragma: no cover - ray is a dependency
        return err
    while isinstance(err, RayTaskError) and err.cause is not None and err.cause is not err:
        err = err.cause
    return err


def is_death(err: BaseException) -> bool:
    """Whether ``err`` (a call's error, as Ray raised it) says the worker's process is gone:
    the one test of a death, for the classification, the controller's waits and a sharded
    replica's leader."""
    from ray.exceptions import RayActorError, WorkerCrashedError

    # ActorDiedError and ActorUnavailableError are RayActorErrors.
    return isinstance(err, (RayActorError, WorkerCrashedError, WorkerExited))


def classify(
    errors: dict[str, BaseException],
    *,
    hung: tuple[str, ...] = (),
    preempting: tuple[str, ...] = (),
    live_after: int,
    step: int | None = None,
) -> Failure:
    """Turns what went wrong in one step into one :class:`Failure`.

    ``errors`` maps worker names to the exception each one's call raised (Ray
    or torch), ``hung`` names workers found hung, ``preempting`` those that got a
    preemption notice, ``live_after`` how many replicas would still hold state
    once the faulty ones are gone. Root causes win over consequences: a user's
    exception over a death, a death over a survivor's collective error, which
    is never a root cause unless nothing else explains it.
    """
    user: list[tuple[str, UserCodeError]] = []
    dead: list[str] = []
    broken: list[tuple[str, InfrastructureError | InternalError]] = []
    nonfinite: list[str] = []
    storage: list[tuple[str, StorageError]] = []
    peer: list[str] = []
    for name, raw in errors.items():
        err = root_cause(raw)
        if isinstance(err, UserCodeError):
            user.append((name, err))
        elif is_death(raw) or is_death(err) or isinstance(err, WorkerLost):
            dead.append(name)  # WorkerLost: a sharded replica's leader lost one of its workers
        elif isinstance(err, (InfrastructureError, InternalError)):
            broken.append((name, err))
        elif isinstance(err, NonFiniteLoss):
            nonfinite.append(name)
        elif isinstance(err, StorageError):
            storage.append((name, err))
        elif is_consequence(err):
            peer.append(name)  # a consequence of another worker's failure, never a cause
        else:  # planaria's own code failed on that worker (an invariant, a stale generation)
            broken.append(
                (
                    name,
                    InternalError(
                        f"planaria internal error on {name}: {type(err).__name__}: {err}",
                        remote_traceback=_format(err),
                        workers=(name,),
                        step=step,
                    ),
                )
            )

    if user:
        name, err = user[0]
        return type(err)(
            str(err.args[0]) if err.args else "user code raised",
            remote_traceback=err.remote_traceback,
            workers=err.workers if isinstance(err, WorkFault) and err.workers else (name,),
            step=step if step is not None else err.step,
            work=err.work,
        )
    faulty = tuple(sorted(set(dead) | set(hung) | {n for n, _ in broken}, key=_worker_order))
    if faulty and live_after <= 0:
        return AllReplicasLost(
            f"every replica is gone ({', '.join(faulty)} lost, hung or broken)",
            workers=faulty,
            step=step,
        )
    if dead:
        return WorkerLost(f"worker {', '.join(faulty)} lost", workers=faulty, step=step)
    if hung:
        return WorkerHung(f"worker {', '.join(faulty)} hung", workers=faulty, step=step)
    if broken:
        name, first = broken[0]
        cls = type(first)
        failure = cls(
            f"{first.args[0] if first.args else cls.kind} (on {', '.join(faulty)})",
            remote_traceback=first.remote_traceback,
            workers=faulty,
            step=step if step is not None else first.step,
            work=first.work,
        )
        # Every worker's raised error, for the attribution (planaria.control.attribution): a step
        # may fail on several workers at once, on different samples.
        failure.raised = [
            (n, e.work, signature(str(e.args[0]) if e.args else e.kind))
            for n, e in broken if isinstance(e, InfrastructureError)
        ]
        return failure
    if storage:
        return StorageError(str(storage[0][1]), workers=(), step=step)
    if nonfinite:
        return NonFiniteLoss(f"non-finite loss at step {step}", workers=(), step=step)
    if preempting:
        return Preempted(f"worker {', '.join(preempting)} preempted", workers=preempting, step=step)
    if peer:
        # Only consequences and nobody dead: some peer must have failed unseen.
        return WorkerLost(
            f"collective failed on {', '.join(peer)} with no dead worker seen",
            workers=(),
            step=step,
        )
    return WorkerLost("step failed for an unknown reason", step=step)


def _worker_order(name: str) -> int:
    return int(name[1:]) if name[1:].isdigit() else 0


def _format(err: BaseException) -> str:
    import traceback

    return "".join(traceback.format_exception(err))
