"""What the checkpoint coordinator needs from the job that runs it, as small Protocols.

The coordinator (:mod:`planaria.checkpoint.coordinator`) and its parts never see the
job itself: they see these views of it, each naming exactly the members they use. The
controller's :class:`~planaria.control.job.Job` provides all of them (:class:`CheckpointHost`);
a test provides a small fake.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "CheckpointHost",
    "Commits",
    "DataPlanView",
    "EventSink",
    "Events",
    "FaultCounts",
    "Member",
    "Membership",
    "ReplicaShape",
    "SavedState",
    "WorkerCalls",
]


class Member(Protocol):
    """One worker of the current generation.

    ``actor`` is its Ray actor handle: the coordinator calls ``ckpt_probe``, ``ckpt_start``,
    ``ckpt_start_beside``, ``ckpt_wait``, ``ckpt_poll``, ``ckpt_freeze``, ``ckpt_advance``,
    ``ckpt_read`` and ``ckpt_apply`` on it with ``.remote(...)``
    (:mod:`planaria.worker.ckpt_save` and :mod:`planaria.worker.ckpt_restore` answer them).
    ``node`` is the host it runs on. ``has_state`` says it holds the committed
    state: a restore sets it (True once every member loaded a checkpoint, False when a
    restore failed part-way and the members' tensors may be half written).
    """

    @property
    def name(self) -> str: ...

    @property
    def actor(self) -> Any: ...

    @property
    def node(self) -> str | None: ...

    has_state: bool


class ReplicaShape(Protocol):
    """How a replica is laid out: ``workers_per_replica`` workers shard one replica's state
    (each writes and reads its own shards)."""

    @property
    def workers_per_replica(self) -> int: ...


class Membership(Protocol):
    """Who the workers are now.

    ``gen``: the current generation (every worker call carries it; a worker refuses an
    older one). ``members``: its workers in rank order; ``names`` their names and ``width``
    their count (both follow ``members`` at once when a worker is evicted, so a writer
    that left is told from one that lives by ``names``). ``config``: the replicas' layout.
    """

    @property
    def gen(self) -> int: ...

    @property
    def members(self) -> Sequence[Member]: ...

    @property
    def names(self) -> Sequence[str]: ...

    @property
    def width(self) -> int: ...

    @property
    def config(self) -> ReplicaShape: ...


class WorkerCalls(Protocol):
    """Waiting on worker calls, the job's one way to judge them."""

    def gather(
        self, refs: dict[str, Any], *, deadline_s: float, step: int | None,
        poll: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Waits for one call per worker (``refs``: name -> the call's Ray ref) and returns
        their answers by name. A worker that dies, hangs (judged by its heartbeat and
        progress, ``deadline_s`` being the last resort) or fails raises the classified
        :class:`~planaria.faults.errors.Failure`; the coordinator passes it on. ``step`` is the
        step the calls belong to (None: not a step); ``poll`` is called between waits."""
        ...


class DataPlanView(Protocol):
    """The job's data plan, as far as a checkpoint records it: ``describe()`` is compared
    with a checkpoint's on restore, ``position(step)`` goes in the manifest."""

    def describe(self) -> dict[str, int]: ...

    def position(self, step: int) -> dict[str, int]: ...


class SavedState(Protocol):
    """Something whose state a checkpoint carries in its metadata (the step deadline's
    window): JSON-able both ways."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Commits(Protocol):
    """The job's committed progress, which a checkpoint saves and a restore sets back.

    ``steps_done``: the committed step count; a save takes it, a restore sets it to the
    checkpoint's step. ``commit_all()`` makes every worker apply the committed steps now
    (before a snapshot). ``skipped_samples``: samples never to be loaded again (saved; a
    restore adds the checkpoint's). ``deadline``: the step deadline (saved; loaded on
    resume). ``plan``: the data plan (None before the job started). ``ledger``: the data
    ledger, only tested for None (a restart reads the run directory's ledger to count the
    steps lost). ``run_dir``: the run directory (the default root is under it).
    """

    steps_done: int

    def commit_all(self) -> None: ...

    @property
    def skipped_samples(self) -> set[int]: ...

    @property
    def deadline(self) -> SavedState: ...

    @property
    def plan(self) -> DataPlanView | None: ...

    @property
    def ledger(self) -> object | None: ...

    @property
    def run_dir(self) -> Path: ...


class EventSink(Protocol):
    """The job's event log: ``emit`` writes one event and returns its record."""

    def emit(self, event: str, **fields: Any) -> dict[str, Any]: ...


class FaultCounts(Protocol):
    """How many failures and preemptions the job has had (the automatic interval learns
    the failure rate from them)."""

    @property
    def failures(self) -> int: ...

    @property
    def preemptions(self) -> int: ...


class Events(Protocol):
    """What the coordinator tells: ``log`` (its ``checkpoint_*``, ``restore`` and
    ``retention_failed`` events), ``hook(phase, **info)`` (the job's hooks, called at
    ``save`` once the writers were told to write and at ``restore`` once the reads are in
    flight: fault campaigns inject there), and ``recovery``, whose counts it reads."""

    @property
    def log(self) -> EventSink: ...

    def hook(self, phase: str, **info: Any) -> None: ...

    @property
    def recovery(self) -> FaultCounts: ...


class CheckpointHost(Membership, WorkerCalls, Commits, Events, Protocol):
    """Everything the coordinator uses of the job: the four views above."""
