"""Evaluation: the committed state measured on the eval set, split over the live replicas.

Every ``RunConfig.eval_every`` committed steps (the boundary planner ends a run there) and
on demand (:meth:`Job.evaluate <planaria.control.job.Job.evaluate>`), the controller makes
every worker apply the committed steps, then asks the replica of place p of the width for
the eval batches j with ``j % width == p`` (:func:`~planaria.wire.evaluation.eval_batches`).
:func:`combine` takes the batches' figures in batch order, in float64, to each metric's
sample-weighted mean: the same figures at any width. A worker that fails meanwhile is a
fault like any other (the caller recovers, then the evaluation at that step runs again
over the new width); an evaluation is recorded once per step (a later one at the same step
replaces it), in :attr:`Evaluation.results` and as an ``eval`` event.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from planaria.faults.errors import ConfigError, ElasticRuntimeError
from planaria.wire.evaluation import EvalBatch, EvalReport, EvalResult, num_eval_batches

if TYPE_CHECKING:
    from planaria.config import RunConfig, TrainSpec
    from planaria.control.protocols import Gather, Roster, StepCount
    from planaria.observe.events import EventLog

__all__ = ["EVAL_DEADLINE_S", "Evaluation", "check_eval_config", "combine", "gather_batches"]

EVAL_DEADLINE_S = 3600.0
"""The last-resort deadline of an evaluation's calls; a worker stuck sooner is found by its
progress (each batch is progress, as a micro-batch is) or its heartbeat."""


def check_eval_config(spec: TrainSpec, config: RunConfig) -> None:
    """Raises ConfigError for ``eval_every`` without an eval dataset."""
    if config.eval_every is not None and spec.eval_dataset is None:
        raise ConfigError(
            f"eval_every={config.eval_every} is not valid without an eval set: give "
            "TrainSpec(eval_dataset=..., evaluate=...) or leave eval_every=None"
        )


def combine(batches: Iterable[EvalBatch]) -> dict[str, float]:
    """Each metric's sample-weighted mean over ``batches``, summed in batch-index order in
    float64 (Python floats), so that the figures do not depend on who ran which batch. A
    metric some batches lack is the mean over those that have it."""
    sums: dict[str, float] = {}
    weights: dict[str, int] = {}
    for batch in sorted(batches, key=lambda b: b.index):
        for key, value in batch.metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value) * batch.samples
            weights[key] = weights.get(key, 0) + batch.samples
    return {key: sums[key] / weights[key] if weights[key] else float("nan") for key in sums}


def gather_batches(reports: Iterable[EvalReport], batch_size: int) -> list[EvalBatch]:
    """Every batch of the eval set, once, from the replicas' reports; an
    ElasticRuntimeError if the replicas' eval sets differ in size or a batch is missing or
    repeated (a planaria bug, not the user's)."""
    reports = list(reports)
    sizes = {r.num_samples for r in reports}
    if len(sizes) != 1:
        raise ElasticRuntimeError(f"the replicas' eval sets differ in size: {sorted(sizes)}")
    expected = list(range(num_eval_batches(sizes.pop(), batch_size)))
    batches = sorted((b for r in reports for b in r.batches), key=lambda b: b.index)
    if [b.index for b in batches] != expected:
        raise ElasticRuntimeError(
            f"an evaluation's batches are {[b.index for b in batches]}, not {expected}")
    return batches


class Evaluation:
    """Evaluates a job's committed state (:meth:`evaluate`, :meth:`if_due`) and keeps the
    results (one per step). ``commit_all`` makes every member apply the committed steps."""

    def __init__(self, *, spec: TrainSpec, roster: Roster, calls: Gather, steps: StepCount,
                 commit_all: Callable[[], None], log: EventLog,
                 eval_every: int | None) -> None:
        self.spec = spec
        self.roster = roster
        self.calls = calls
        self.steps = steps
        self.commit_all = commit_all
        self.log = log
        self.eval_every = eval_every
        self.results: list[EvalResult] = []

    @property
    def batch_size(self) -> int:
        return self.spec.eval_batch_size or self.spec.micro_batch_size

    def due(self) -> bool:
        """An evaluation is due: ``eval_every`` divides the committed steps (not 0), and
        none was recorded at this step."""
        every, step = self.eval_every, self.steps.steps_done
        return (every is not None and step > 0 and step % every == 0
                and not any(r.step == step for r in self.results))

    def if_due(self) -> EvalResult | None:
        """Evaluates now if an evaluation is due (see :meth:`due`)."""
        return self.evaluate() if self.due() else None

    def evaluate(self) -> EvalResult:
        """Evaluates the committed state over the live replicas and records it; raises the
        Failure of a worker that fails meanwhile (recover, then evaluate again)."""
        if self.spec.eval_dataset is None:
            raise ConfigError("evaluate() is not valid without TrainSpec(eval_dataset=...)")
        t0 = time.perf_counter()
        self.commit_all()
        step, members, gen = self.steps.steps_done, self.roster.members, self.roster.gen
        width = len(members)
        refs = {h.name: h.actor.evaluate.remote(gen, step, place, width)
                for place, h in enumerate(members)}
        answers: dict[str, EvalReport] = self.calls.gather(refs, deadline_s=EVAL_DEADLINE_S,
                                                           step=None)
        behind = {n: a.steps_done for n, a in answers.items() if a.steps_done != step}
        if behind:
            raise ElasticRuntimeError(f"evaluated at step {step} on replicas at {behind}")
        batches = gather_batches(answers.values(), self.batch_size)
        result = EvalResult(step=step, metrics=combine(batches),
                            samples=sum(b.samples for b in batches),
                            seconds=time.perf_counter() - t0)
        self.record(result, width=width)
        return result

    def record(self, result: EvalResult, *, width: int) -> None:
        """Keeps ``result`` (replacing one at the same step; in step order) and logs the
        ``eval`` event."""
        self.results = sorted([r for r in self.results if r.step != result.step] + [result],
                              key=lambda r: r.step)
        self.log.emit("eval", step=result.step, metrics=result.metrics, samples=result.samples,
                      seconds=result.seconds, width=width)
