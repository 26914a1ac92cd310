"""Evaluation on real workers: the same figures at any width, training left alone, and a
worker killed mid-evaluation recovered from as during training."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch

import planaria
from planaria import Job, RunConfig, UserCodeError, fit
from planaria.examples import mlp
from tests.assertions import (
    assert_exactly_once,
    assert_same_state,
    events,
    of,
    run_with_evals,
)

# The workers unpickle this module's helpers by value: they cannot import the tests package.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

N, G, STEPS, EVERY = 256, 64, 6, 2
EVAL_N, EVAL_BS = 100, 16  # 7 batches, the last of 4 samples


def eval_set() -> mlp.Regression:
    return mlp.Regression(n=EVAL_N, seed=7)


def metrics(model: torch.nn.Module, batch: Any) -> dict[str, Any]:
    x, y = batch
    out = model(x)
    # Draws from every global generator: the training's streams must not notice.
    noise = torch.rand(()) * 0 + float(np.random.rand()) * 0
    return {"mse": torch.nn.functional.mse_loss(out, y) + noise,
            "mae": (out - y).abs().mean().item()}


def spec(**changes: Any) -> planaria.TrainSpec:
    fields = {"eval_dataset": eval_set, "evaluate": metrics, "eval_batch_size": EVAL_BS}
    return dataclasses.replace(mlp.make_spec(n=N, global_batch_size=G), **{**fields, **changes})


def figures(evals: list[planaria.EvalResult]) -> list[tuple[int, dict[str, float], int]]:
    return [(e.step, e.metrics, e.samples) for e in evals]


def assert_close_figures(a: list[planaria.EvalResult], b: list[planaria.EvalResult]) -> None:
    """Equal steps and samples; metrics as close as the weights they measure (a width's
    training differs from another's by the summation order of its gradient)."""
    assert [(e.step, e.samples) for e in a] == [(e.step, e.samples) for e in b]
    for x, y in zip(a, b, strict=True):
        assert x.metrics.keys() == y.metrics.keys()
        torch.testing.assert_close(x.metrics, y.metrics, atol=1e-6, rtol=1e-5)


def one_process_figures() -> dict[str, float]:
    """The step-0 evaluation computed here, in one process on one thread: the initial model
    (built as a worker builds it) over the eval set's batches, sample-weighted in order."""
    from torch.utils.data import default_collate

    from planaria.data.randomness import factory_seed, seed_globals

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seed_globals(factory_seed(0, "model"))
        model = mlp.make_model().eval()
        data = eval_set()
        sums = {"mse": 0.0, "mae": 0.0}
        with torch.no_grad():
            for start in range(0, EVAL_N, EVAL_BS):
                ids = range(start, min(start + EVAL_BS, EVAL_N))
                got = metrics(model, default_collate([data[i] for i in ids]))
                for key in sums:
                    sums[key] += float(got[key]) * len(ids)
    finally:
        torch.set_num_threads(threads)
    return {key: value / EVAL_N for key, value in sums.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ray_cluster):
    """The fault-free run at 3 replicas, evaluating on demand at step 0, then every 2 steps:
    (step 0's result, the results of steps 2, 4, 6, the final weights, the records heard)."""
    heard: list[dict] = []
    run_dir = tmp_path_factory.mktemp("ref")
    job = Job(spec(), RunConfig(steps=STEPS, replicas=3, run_dir=run_dir, eval_every=EVERY,
                                threads_per_worker=1), listeners=[heard.append])
    with job:
        first = job.evaluate()
        run_with_evals(job, STEPS)
        state = job.model_state_dict()
        evals = [e for e in job.evaluation.results if e.step]
    return first, evals, state, heard, run_dir


def test_figures_equal_at_1_and_3_replicas_and_training_left_alone(tmp_path, reference):
    first, evals, state, heard, run_dir = reference
    # The same weights give the same figures, exactly, at any width.
    assert first.step == 0 and first.samples == EVAL_N
    assert first.metrics == one_process_figures()
    assert [e.step for e in evals] == [2, 4, 6]
    assert all(e.samples == EVAL_N and set(e.metrics) == {"mse", "mae"} for e in evals)
    assert [r["step"] for r in heard if r["event"] == "eval"] == [0, 2, 4, 6]  # the listeners
    assert [e["step"] for e in of(events(run_dir), "eval")] == [0, 2, 4, 6]
    one = fit(spec(), steps=STEPS, replicas=1, run_dir=tmp_path / "one", eval_every=EVERY,
              threads_per_worker=1)
    assert_close_figures(one.evals, evals)
    # Evaluating changed nothing the training reads: the same weights, bit for bit.
    plain = fit(spec(), steps=STEPS, replicas=3, run_dir=tmp_path / "plain",
                threads_per_worker=1)
    assert plain.evals == []
    assert_same_state(plain.state_dict, state, atol=0, rtol=0)


def marked_collate(samples: list[Any]) -> tuple[Any, ...]:
    from torch.utils.data import default_collate

    return (*default_collate(samples), "eval")


def count_marked(model: torch.nn.Module, batch: Any) -> dict[str, float]:
    return {"marked": float(len(batch) == 3 and batch[2] == "eval")}


def test_the_eval_collate_batches_the_eval_set_and_the_training_keeps_its_own(tmp_path):
    job = Job(spec(evaluate=count_marked, eval_collate=marked_collate),
              RunConfig(steps=1, replicas=1, run_dir=tmp_path, threads_per_worker=1))
    with job:
        job.run_steps(1)  # the training's batches are default_collate's (x, y)
        assert job.evaluate().metrics == {"marked": 1.0}


class KillAtBatch:
    """At the evaluation after ``step`` steps, batch ``batch``: this worker dies (once)."""

    def __init__(self, step: int, batch: int, marker: str) -> None:
        self.step, self.batch, self.marker = step, batch, marker

    def __call__(self, *, worker: Any, step: int, batch: int) -> None:
        if step == self.step and batch == self.batch and not os.path.exists(self.marker):
            Path(self.marker).write_text(worker.name)
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_mid_evaluation_is_recovered_from(tmp_path, reference):
    _, ref_evals, ref_state, _, _ = reference
    marker = tmp_path / "killed"
    job = Job(spec(), RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path / "run",
                                ledger=True, eval_every=EVERY, threads_per_worker=1))
    with job:
        w1 = next(h for h in job.members if h.name == "w1")
        # w1 (place 1 of 3) runs batches 1 and 4: it dies at its second.
        ray.get(w1.actor.arm_fault.remote("worker.eval_batch", KillAtBatch(4, 4, str(marker))))
        run_with_evals(job, STEPS)
        state = job.model_state_dict()
        evals = list(job.evaluation.results)
    assert marker.read_text() == "w1"
    evs = events(tmp_path / "run")
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_lost"]
    assert [e["step"] for e in of(evs, "eval")] == [2, 4, 6]  # step 4's once, after recovery
    assert of(evs, "eval")[1]["width"] < 3 or of(evs, "joined")  # over the new width
    # Steps 2 and 4 evaluate the weights of the fault-free run: the same figures, exactly
    # (step 4's over another width); after it, the training ran at another width too.
    assert figures(evals[:2]) == figures(ref_evals[:2])
    assert_close_figures(evals, ref_evals)
    assert_same_state(ref_state, state)
    assert_exactly_once(tmp_path / "run", num_samples=N, global_batch_size=G, steps=STEPS)


def broken(model: torch.nn.Module, batch: Any) -> dict[str, Any]:
    raise KeyError("no such metric")


def test_an_error_in_evaluate_stops_the_job_as_the_users(tmp_path):
    with pytest.raises(UserCodeError, match="evaluate function raised KeyError"):
        fit(spec(evaluate=broken), steps=2, replicas=1, run_dir=tmp_path, eval_every=1)


def val_windows() -> torch.utils.data.Dataset:
    from planaria.examples import tiny_gpt

    return torch.utils.data.Subset(tiny_gpt.CharWindows("val"), range(22))


def test_a_sharded_replica_evaluates_with_its_workers_together(tmp_path):
    """2 replicas of 2 workers (FSDP2 inside each): every worker of a replica runs the
    replica's batches; the figures are the whole model's, and training goes on after."""
    from torch.utils.data import default_collate

    from planaria.data.randomness import factory_seed, seed_globals
    from planaria.examples import tiny_gpt

    sharded = dataclasses.replace(tiny_gpt.make_spec(dim=32, layers=2, dropout=0.1),
                                  eval_dataset=val_windows, eval_batch_size=4)
    job = Job(sharded, RunConfig(steps=2, replicas=2, workers_per_replica=2,
                                 run_dir=tmp_path, eval_every=2))
    with job:
        first = job.evaluate()
        run_with_evals(job, 2)
        evals = list(job.evaluation.results)
    assert [e.step for e in evals] == [0, 2] and all(e.samples == 22 for e in evals)
    assert set(first.metrics) == {"loss", "bits_per_byte"}  # by the loss: its metrics too
    seed_globals(factory_seed(0, "model"))
    model = sharded.model().eval()  # the whole model, in this process
    data = val_windows()
    with torch.no_grad():
        total = sum(float(tiny_gpt.lm_loss(model, default_collate(  # (loss, metrics)
            [data[i] for i in range(s, min(s + 4, 22))]))[0]) * min(4, 22 - s)
            for s in range(0, 22, 4))
    torch.testing.assert_close(first.metrics["loss"], total / 22, atol=1e-5, rtol=1e-5)
