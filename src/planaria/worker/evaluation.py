"""A replica's part of an evaluation: the eval dataset, and the batches it runs.

The eval dataset is built from ``spec.eval_dataset`` at the first evaluation (with the
generators seeded from (seed, "eval_dataset"), as every factory). An evaluation runs the
batches :func:`~planaria.wire.evaluation.eval_batches` gives this replica's place, under
``model.eval()`` and ``torch.no_grad()`` (and the training's autocast), each with torch
seeded from (seed, step, batch) and each sample served in its own scope, so a batch's
figures do not depend on the width or on the replica that runs it; a batch is collated by
``spec.eval_collate``, or else by the training's collate. The global generators' states
are put back afterwards and the model is put back in training mode: an evaluation changes
nothing the training reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from planaria.data.randomness import GlobalStates, eval_batch_seed, seed_torch, serve_samples
from planaria.faults.errors import Failure, UserCodeError
from planaria.faults.points import FaultPoints
from planaria.faults.user_code import user_call
from planaria.wire.evaluation import EvalBatch, EvalReport, eval_batches
from planaria.worker.busy import current_thread_ids
from planaria.worker.commit import Commits
from planaria.worker.loader import to_device
from planaria.worker.membership import Membership
from planaria.worker.replica_state import ReplicaState, run_factory
from planaria.worker.vitals import Vitals

__all__ = ["Evaluator", "metric_floats"]


def metric_floats(metrics: Any) -> dict[str, float]:
    """``evaluate``'s answer as floats; a UserCodeError unless it is a mapping of names to
    numbers or one-element tensors."""
    if not isinstance(metrics, Mapping):
        raise UserCodeError(f"the evaluate function returned {type(metrics).__name__}, not a "
                            "mapping {metric name: the batch's mean}")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        try:
            out[str(key)] = float(value.detach() if isinstance(value, torch.Tensor) else value)
        except (TypeError, ValueError, RuntimeError) as err:
            raise UserCodeError(f"the evaluate function's metric {key!r} is not a number or a "
                                f"one-element tensor: {err}") from err
    return out


class Evaluator:
    """Runs this replica's batches of an evaluation (:meth:`run`)."""

    def __init__(self, name: str, state: ReplicaState, commits: Commits, membership: Membership,
                 vitals: Vitals, faults: FaultPoints, collate: Callable[[], Any]) -> None:
        """``faults``: the worker's fault points (``worker.eval_batch``); ``collate``: the loader's
        collate function, once the loader is set up."""
        self.name = name
        self.spec = state.spec
        self.state = state
        self.commits = commits
        self.membership = membership
        self.vitals = vitals
        self.faults = faults
        self.collate = collate
        self.dataset: Any = None

    def build(self) -> Any:
        """The eval dataset, built at the first evaluation; the generators' states kept."""
        if self.dataset is None:
            spec = self.spec
            if spec.eval_dataset is None:
                raise UserCodeError("an evaluation needs TrainSpec(eval_dataset=...)")
            saved = GlobalStates.save()
            try:
                self.dataset = run_factory("eval_dataset", spec.seed, spec.eval_dataset)
            finally:
                saved.restore()
        return self.dataset

    def run(self, step: int, place: int, width: int) -> EvalReport:
        """Evaluates the applied state on the batches of place ``place`` of ``width``; the
        evaluation is the one after ``step`` committed steps (its batches' seeds)."""
        self.state.refuse_if_dirty(self.name, "evaluate")
        self.vitals.train_thread = current_thread_ids()
        size = self.spec.eval_batch_size or self.spec.micro_batch_size
        model = self.state.compiled
        training = self.state.model.training
        saved = GlobalStates.save()
        batches: list[EvalBatch] = []
        try:
            dataset = self.build()
            num_samples = int(user_call("len(eval_dataset)", len, dataset))
            self.state.model.eval()
            with torch.no_grad():
                for j, ids in eval_batches(num_samples, size, place, width):
                    batches.append(self._batch(step, j, list(ids), dataset, model))
        except Failure as err:
            err.workers, err.step = (self.name,), step
            raise
        finally:
            self.state.model.train(training)
            saved.restore()
            self.vitals.work = self.vitals.loading = ""
            self.vitals.set_phase("idle", self.commits.steps_done)
        return EvalReport(batches=tuple(batches), num_samples=num_samples,
                          steps_done=self.commits.steps_done)

    def _batch(self, step: int, j: int, ids: list[int], dataset: Any, model: Any) -> EvalBatch:
        """One batch's figures (fault point ``worker.eval_batch`` first)."""
        self.membership.raise_if_aborted(step)
        vitals = self.vitals  # judged as a step's loading and compute are (busy is not hung)
        vitals.set_phase("loading", step)
        vitals.work = vitals.loading = f"e{j}"  # no training work: a hang is the worker's
        if self.faults.armed:
            self.faults.hit("worker.eval_batch", step=step, batch=j)
        samples = user_call("eval_dataset[i]", serve_samples, self.spec.seed, step,
                            dataset.__getitem__, ids, True)
        collate = self.spec.eval_collate or self.collate()
        batch = to_device(user_call("collate", collate, samples), self.state.device)
        vitals.set_phase("compute", step)
        seed_torch(eval_batch_seed(self.spec.seed, step, j))
        with self._autocast():
            metrics = user_call("the evaluate function", self._metrics_fn(), model, batch)
        return EvalBatch(index=j, samples=len(ids), metrics=metric_floats(metrics))

    def _metrics_fn(self) -> Callable[[Any, Any], Any]:
        """``spec.evaluate``, or the loss (and its metrics) as ``{"loss": ...}``."""
        spec = self.spec
        if spec.evaluate is not None:
            return spec.evaluate
        loss_fn = spec.loss
        assert loss_fn is not None  # TrainSpec refuses eval_dataset with neither

        def by_loss(model: Any, batch: Any) -> dict[str, Any]:
            out = loss_fn(model, batch)
            loss, extra = out if isinstance(out, tuple) else (out, {})
            return {"loss": loss, **extra}

        return by_loss

    def _autocast(self) -> Any:
        """The training's mixed precision (``spec.precision``); a no-op in full precision."""
        if self.spec.precision is None:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.spec.precision == "bf16" else torch.float16
        return torch.autocast(self.state.device.type, dtype=dtype)
