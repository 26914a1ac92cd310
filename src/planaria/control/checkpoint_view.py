"""The job as the checkpoint coordinator sees it, made of the controller's parts.

The coordinator (:class:`~planaria.checkpoint.coordinator.Checkpointer`) reads and sets a
few things of the job (:class:`~planaria.checkpoint.host.CheckpointHost`: who the members
are, the one way to wait on their calls, the committed progress, the event log and the
hooks). :class:`CheckpointView` answers each from the part that owns it, so the
coordinator never holds the :class:`~planaria.control.job.Job`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planaria.control.facade import Delegated
from planaria.faults.errors import ElasticRuntimeError

if TYPE_CHECKING:
    from planaria.checkpoint.host import FaultCounts
    from planaria.config import RunConfig
    from planaria.control.calls import Calls
    from planaria.control.commit_log import CommitLog
    from planaria.control.hooks import FaultHooks
    from planaria.control.membership import Membership
    from planaria.control.pool import WorkerHandle
    from planaria.control.watchdog import StepDeadline
    from planaria.data.plan import DataPlan, Ledger
    from planaria.observe.events import EventLog

__all__ = ["CheckpointView"]


class CheckpointView:
    """A :class:`~planaria.checkpoint.host.CheckpointHost` over the membership, the calls,
    the commit log (the only writer of ``steps_done``: a restore sets it through
    :meth:`CommitLog.restart_at`), the event log and the hooks. ``recovery`` (the failure
    counts) is set once the recovery is built, after the coordinator."""

    def __init__(self, *, membership: Membership, calls: Calls, commit_log: CommitLog,
                 log: EventLog, hooks: FaultHooks, run_dir: Path) -> None:
        self.membership = membership
        self.calls = calls
        self.commit_log = commit_log
        self.log = log
        self.hooks = hooks
        self.run_dir = run_dir
        self.counts: FaultCounts | None = None

    members: Delegated[list[WorkerHandle]] = Delegated("membership")
    gen: Delegated[int] = Delegated("membership")
    width: Delegated[int] = Delegated("membership")
    names: Delegated[list[str]] = Delegated("membership")
    config: Delegated[RunConfig] = Delegated("membership")
    plan: Delegated[DataPlan | None] = Delegated("commit_log")
    ledger: Delegated[Ledger | None] = Delegated("commit_log")
    skipped_samples: Delegated[set[int]] = Delegated("commit_log")
    deadline: Delegated[StepDeadline] = Delegated("commit_log")

    @property
    def steps_done(self) -> int:
        return self.commit_log.steps_done

    @steps_done.setter
    def steps_done(self, step: int) -> None:
        self.commit_log.restart_at(step)

    @property
    def recovery(self) -> FaultCounts:
        if self.counts is None:
            raise ElasticRuntimeError("the checkpoint coordinator asked for the failure "
                                      "counts before the recovery was built")
        return self.counts

    def commit_all(self) -> None:
        self.membership.commit_all()

    def gather(self, refs: dict[str, Any], *, deadline_s: float, step: int | None,
               poll: Callable[[], None] | None = None) -> dict[str, Any]:
        return self.calls.gather(refs, deadline_s=deadline_s, step=step, poll=poll)

    def hook(self, phase: str, **info: Any) -> None:
        self.hooks.call(phase, **info)
