"""What the controller does about each kind of failure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from planaria.config import check
from planaria.faults.errors import Failure

__all__ = ["HangConfig", "RecoveryPolicy"]

WorkerLostAction = Literal["resize", "pause", "restore", "abort"]
NonFiniteAction = Literal["skip", "rollback", "abort"]
WorkFaultAction = Literal["stop", "skip"]


@dataclass(frozen=True, kw_only=True)
class RecoveryPolicy:
    """Maps failures to actions; separate budgets for failures and preemptions."""

    on_worker_lost: WorkerLostAction = "resize"
    """resize: go on with the survivors while a replacement starts; pause: wait for it;
    restore: reload the latest checkpoint; abort: stop."""
    min_replicas: int = 1
    """Below this many live replicas the job waits for replacements (up to pause_timeout_s)."""
    pause_timeout_s: float = 120.0
    """How long to wait for replacements in pause mode or below min_replicas, then abort."""
    max_failures: int = 10
    """Unplanned failures (lost, hung, all lost) tolerated before giving up."""
    max_preemptions: int = 100
    """Planned departures (preemption notices) tolerated before giving up."""
    on_nonfinite: NonFiniteAction = "abort"
    """skip: drop the step's update; rollback: restore the latest checkpoint (a step that is
    non-finite again after its rollback is skipped); abort: stop."""
    max_nonfinite: int = 10
    """Non-finite steps (loss or reduced gradient) tolerated before giving up."""
    on_work_fault: WorkFaultAction = "stop"
    """A fault of the work, not of a worker (the same sample or micro-batch failing the same
    way on two workers, see planaria.control.attribution): stop with a save and an error naming the
    work, or skip its samples (each skip recorded in the event log, the ledger and the
    checkpoints; the step's gradient is then the sum over the samples served ÷ the global
    batch size) and go on."""
    max_skipped_samples: int = 100
    """With on_work_fault="skip": skip at most this many samples in the run, then stop."""
    replace_workers: bool = True
    """Ask Ray for a replacement whenever a worker leaves."""
    max_replacement_attempts: int = 5
    """Start attempts per replacement before giving up on it (with exponential backoff)."""
    allow_restart_from_scratch: bool = False
    """When checkpoints exist but none can be restored, start over from step 0 (False: stop
    with an error that says what would be lost)."""
    retry_policy: Callable[[int, Failure], bool] | None = None
    """Optional hook ``(attempt, failure) -> bool``: False stops the job on that failure."""

    def __post_init__(self) -> None:
        check(
            self.on_worker_lost in ("resize", "pause", "restore", "abort"),
            "on_worker_lost",
            self.on_worker_lost,
            "one of 'resize', 'pause', 'restore', 'abort'",
        )
        check(
            self.on_nonfinite in ("skip", "rollback", "abort"),
            "on_nonfinite",
            self.on_nonfinite,
            "one of 'skip', 'rollback', 'abort'",
        )
        check(self.on_work_fault in ("stop", "skip"), "on_work_fault", self.on_work_fault,
              "'stop' or 'skip'")
        check(isinstance(self.max_skipped_samples, int) and self.max_skipped_samples >= 0,
              "max_skipped_samples", self.max_skipped_samples, "an integer >= 0")
        check(isinstance(self.allow_restart_from_scratch, bool), "allow_restart_from_scratch",
              self.allow_restart_from_scratch, "True or False")
        check(self.min_replicas >= 1, "min_replicas", self.min_replicas, "an integer >= 1")
        check(self.pause_timeout_s > 0, "pause_timeout_s", self.pause_timeout_s, "seconds > 0")
        check(self.max_failures >= 0, "max_failures", self.max_failures, "an integer >= 0")
        check(self.max_nonfinite >= 0, "max_nonfinite", self.max_nonfinite, "an integer >= 0")
        check(self.max_preemptions >= 0, "max_preemptions", self.max_preemptions, "an integer >= 0")
        check(
            self.max_replacement_attempts >= 1,
            "max_replacement_attempts",
            self.max_replacement_attempts,
            "an integer >= 1",
        )
        check(
            self.retry_policy is None or callable(self.retry_policy),
            "retry_policy",
            self.retry_policy,
            "a callable (attempt, failure) -> bool, or None",
        )


@dataclass(frozen=True, kw_only=True)
class HangConfig:
    """The hang watchdog: a per-step deadline learned from observed step times."""

    factor: float = 4.0
    """Deadline = factor x the slowest recent step ..."""
    floor_s: float = 5.0
    """... but never below this ..."""
    ceiling_s: float = 600.0
    """... nor above this (also the deadline before any step was seen)."""
    window: int = 20
    """How many recent steps to learn from."""
    heartbeat_s: float = 0.25
    """How often each worker's heartbeat thread reports its phase."""
    heartbeat_timeout_s: float = 10.0
    """A worker whose heartbeat is older than this during a step is hung (stopped or frozen).
    Above the pauses a healthy process shows (a long GC, swap, a noisy neighbour stall a
    whole process for seconds), and raised in a running job to a multiple of the longest
    gap between beats a live worker reports (see planaria.control.liveness): a process that pauses
    is not a process that stopped. Deaths do not wait for it (Ray reports them at once), nor
    do stuck threads (judged by progress against the step deadline)."""
    io_timeout_s: float = 120.0
    """A worker loading its samples (``dataset[i]``) with no sample done for longer than this
    (or the step deadline, if longer) is hung: a slow read is judged by an I/O deadline, not
    by the step's."""
    recheck_s: float = 2.0
    """A wait in which no worker call has ended for this long asks Ray whether one has (a
    completion notice that never came costs this long; see planaria.control.call_watch)."""
    wait_report_s: float = 30.0
    """A wait longer than the step deadline logs whom it still waits for, and their
    heartbeats, this often (not while steps commit)."""

    def __post_init__(self) -> None:
        check(self.factor >= 1, "factor", self.factor, "a number >= 1")
        check(
            0 < self.floor_s <= self.ceiling_s, "floor_s", self.floor_s, "0 < floor_s <= ceiling_s"
        )
        check(self.window >= 1, "window", self.window, "an integer >= 1")
        check(self.heartbeat_s > 0, "heartbeat_s", self.heartbeat_s, "seconds > 0")
        check(self.io_timeout_s > 0, "io_timeout_s", self.io_timeout_s, "seconds > 0")
        check(self.recheck_s > 0, "recheck_s", self.recheck_s, "seconds > 0")
        check(self.wait_report_s > 0, "wait_report_s", self.wait_report_s, "seconds > 0")
        check(
            self.heartbeat_timeout_s > self.heartbeat_s,
            "heartbeat_timeout_s",
            self.heartbeat_timeout_s,
            f"more than heartbeat_s={self.heartbeat_s}",
        )
