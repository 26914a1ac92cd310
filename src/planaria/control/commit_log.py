"""The commit log: the only writer of the committed step count and of the ledger.

A step is committed once every live replica applied it (invariant 1, see
:mod:`planaria.control.run_ahead`); :class:`CommitLog` records it (the ``step_committed``
event, the loss history, the step deadline's learning), and writes the ledger's
records of what each rank was served and of the commit, of a step dropped for a
non-finite loss, and of samples skipped for a fault of the work.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from planaria.data.plan import DataPlan, Ledger, split_micro_batches
from planaria.faults.errors import NonFiniteLoss
from planaria.observe.loss_history import LossHistory
from planaria.wire.reports import Joined, Served, StepTotals

if TYPE_CHECKING:
    from planaria.control.takeover import Takeover
    from planaria.control.watchdog import StepDeadline
    from planaria.observe.events import EventLog

__all__ = ["CommitLog", "StepResult"]

_log = logging.getLogger("planaria.commits")

SAMPLES_NAMED = 64  # the ids a dataset_nondeterministic event names (its count has them all)


@dataclass
class StepResult:
    """A committed step as the controller saw it."""

    step: int
    loss: float
    width: int
    duration_s: float
    samples_per_s: float
    metrics: dict[str, float] = field(default_factory=dict)


class CommitLog:
    """What a job committed: ``steps_done``, the losses, the skips, the ledger.

    ``ledger_dir``: where the ledger is written (None: no ledger). ``on_commit(step, t)``
    is called after each step is recorded (the recovery closes its open faults there).
    ``plan``: the data plan, once the workers have named the dataset's size.
    """

    def __init__(self, *, log: EventLog, deadline: StepDeadline, micro_batch_size: int,
                 ledger_dir: Path | None, run_id: str) -> None:
        self.log = log
        self.deadline = deadline
        self.step_callbacks: list[Callable[[StepResult], None]] = []
        """Called with each step as it is committed (``fit``'s ``on_step``), on this thread."""
        self.run_id = run_id
        self.micro_batch_size = micro_batch_size
        self.ledger = (Ledger(ledger_dir, run_id=run_id, on_changed=self._served_changed)
                       if ledger_dir is not None else None)
        self.plan: DataPlan | None = None
        self.on_commit: Callable[[int, float], None] = lambda step, t: None
        self._steps_done = 0
        self.last_skipped = -1  # the newest step whose update was dropped (non-finite): workers
        # learn it with the next call, as they learn of commits (see Worker._settle)
        self.losses = LossHistory()  # every committed step, 16 bytes each
        self.skipped_samples: set[int] = set()  # never loaded again: a work fault, skipped
        self.metric_keys: tuple[str, ...] | None = None  # the loss's metrics, once seen
        self._ledger_last: tuple[int, int] | None = None  # (gen, step) last written as served

    @property
    def steps_done(self) -> int:
        """Steps committed (the next step to run)."""
        return self._steps_done

    # ---- commits -----------------------------------------------------------------------------

    def record_step(self, rec: StepTotals, *, gen: int, width: int) -> StepResult:
        """Records a step a run applied (:mod:`planaria.control.run_ahead`) as committed at its
        ``t`` (events, losses, open faults), from its totals (one rank's record of it, or
        what rank 0 streamed). The ledger is the caller's (:meth:`ledger_step`): it is
        written when the run ends."""
        step, t = rec.step, rec.t
        if rec.overflow:
            # fp16: the loss scale was too high. Not a fault: every replica skipped the
            # update and backed the scale off at apply, as a GradScaler does.
            self.log.emit("step_overflow", step=step, grad_norm=rec.grad_norm, t=t)
        n = rec.global_samples
        loss = rec.loss
        metrics = {k: v / max(1, n) for k, v in rec.global_metric_sums.items()}
        duration = max(1e-9, t - rec.t0)
        self._steps_done = step + 1
        self.deadline.observe(duration)
        result = StepResult(step, loss, width, duration, n / duration, metrics)
        self.losses.append((step, loss))
        self.log.emit(
            "step_committed", t=t, step=step, gen=gen, width=width,
            duration_s=duration, loss=loss, samples=n, samples_per_s=result.samples_per_s,
            data_wait_s=rec.data_wait_s, metrics=metrics, lr=rec.lr, grad_norm=rec.grad_norm,
            **({} if rec.ranks is None else {"ranks": rec.ranks.to_json()}),
        )
        self.on_commit(step, t)
        for callback in self.step_callbacks:
            callback(result)
        return result

    def advance_to(self, step: int) -> None:
        """Every survivor of a failed run applied the steps before ``step``: they count as
        done (their records were recorded already, or were not returned)."""
        self._steps_done = max(self._steps_done, step)

    def commit_saved(self, step: int, served: Mapping[int, Mapping[str, Served]], *,
                     gen: int) -> list[int]:
        """The steps up to ``step`` were applied and saved beside, but never reported (the
        leavers were gone before their run settled): they are committed, in the ledger too
        (``served``: {step: {worker: record}}). Returns the steps committed."""
        steps = list(range(self._steps_done, step))
        if not steps:
            return []
        for s in steps:
            if self.ledger is not None:
                if self._ledger_last == (gen, s):  # its attempt's records are in already
                    self.ledger.commit(s, gen=gen)
                else:
                    self.ledger_step(s, served.get(s) or {}, gen=gen)
        self._steps_done = step
        return steps

    def restore_from(self, takeover: Takeover) -> None:
        """Takes over a run another controller committed (:mod:`planaria.control.takeover`):
        its run (the ledger's records from now on are that run's), its steps, its newest
        skipped step and the samples it skips."""
        self.run_id = takeover.run_id
        if self.ledger is not None:
            self.ledger.run_id = takeover.run_id
        self._steps_done = takeover.steps_done
        self.last_skipped = takeover.last_skipped
        self.skipped_samples = set(takeover.skipped_samples)
        self._ledger_last = None

    def restart_at(self, step: int) -> None:
        """The state of ``step`` was restored (a checkpoint, or the seed's at 0): training
        goes on from there."""
        self._steps_done = step

    def record_nonfinite(self, rec: StepTotals, per_worker: Mapping[str, Served], *,
                         gen: int) -> None:
        """A run stopped at a non-finite step (applied nowhere): raises NonFiniteLoss, and
        the policy decides."""
        step = rec.step
        self.ledger_served(step, per_worker, gen=gen)
        loss, grad_norm = rec.loss, rec.grad_norm
        what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
        raise NonFiniteLoss(f"{what} at step {step}", step=step)

    def skip_pending(self, step: int, *, gen: int) -> None:
        """Drops step ``step``'s update everywhere; the step counts as done (non-finite loss).

        Nothing is sent now: like a commit, the skip rides on each worker's next call, so a
        fault meanwhile cannot leave some workers past the step and others not.
        """
        self.last_skipped = step
        self._steps_done = step + 1
        self.log.emit("step_skipped", step=step, reason="nonfinite_loss")
        if self.ledger is not None:
            self.ledger.commit(step, gen=gen, skipped=True)

    def skip_samples(self, samples: list[int], *, step: int | None, reason: str) -> None:
        """Leaves ``samples`` out of every step from now on (a work fault the policy skips):
        the workers learn it when the next generation is built; the event log, the ledger and
        later checkpoints record it."""
        new = sorted(set(samples) - self.skipped_samples)
        self.skipped_samples.update(new)
        self.log.emit("sample_skipped", samples=new, step=step, reason=reason,
                      total=len(self.skipped_samples))
        if self.ledger is not None:
            self.ledger.skip_samples(new, step=step, reason=reason)
        _log.warning("skipping samples %s from step %s on: %s", new, step, reason)

    # ---- the data --------------------------------------------------------------------------

    def split(self, step: int, width: int) -> list[np.ndarray]:
        """Step ``step``'s sample ids split over ``width`` ranks in whole micro-batches
        (empty parts before the plan)."""
        if self.plan is None:
            return [np.empty(0, dtype=np.int64)] * width
        return split_micro_batches(self.plan.batch(step), width, self.micro_batch_size)

    # ---- the ledger --------------------------------------------------------------------------

    def ledger_step(self, step: int, served: Mapping[str, Served], *, gen: int) -> None:
        """The ledger's records of a step an autonomous run committed: what each rank was
        served, then the commit."""
        if self.ledger is None:
            return
        self.ledger_served(step, served, gen=gen)
        self.ledger.commit(step, gen=gen)

    def ledger_served(self, step: int, served: Mapping[str, Served], *, gen: int) -> None:
        """Records what each rank's dataset served in this attempt (before it may commit):
        ``served`` maps each worker, in rank order, to what it was served."""
        if self.ledger is None:
            return
        for name, s in served.items():
            self.ledger.served(step, gen=gen, worker=name, ids=s.ids, digests=s.digests)
        self._ledger_last = (gen, step)

    def ledger_dropped(self, joined: Mapping[str, Joined]) -> None:
        """Records what survivors were served in a step attempt that failed (from their join)."""
        if self.ledger is None:
            return
        for name, r in joined.items():
            d = r.dropped
            if d and (d.gen, d.step) != self._ledger_last:  # not recorded already
                self.ledger.served(d.step, gen=d.gen, worker=name, ids=d.served.ids,
                                   digests=d.served.digests)

    def _served_changed(self, step: int, gen: int, worker: str, ids: list[int]) -> None:
        """The ledger saw samples of ``step`` served again with other content."""
        message = (
            f"dataset[i] served other content for {len(ids)} sample(s) of step {step} when "
            f"they were served again ({worker}, generation {gen}; samples {ids[:8]}"
            f"{' ...' if len(ids) > 8 else ''}): the dataset is not deterministic (it reads "
            "the clock, a counter, files that change, or a random generator planaria does not "
            "seed), so a run with failures does not compute the fault-free training"
        )
        _log.warning(message)
        self.log.emit("dataset_nondeterministic", step=step, gen=gen, worker=worker,
                      samples=ids[:SAMPLES_NAMED], count=len(ids), message=message)
