"""A worker dies during a step: the survivors keep the micro-batches they finished, and
only the rest is computed again (planaria.worker.kept_work, planaria.control.carry_plan).

Every test asserts the final parameters equal a fault-free run and every sample was used
once; the loss writes the seed of each micro-batch it runs (each micro-batch's torch
stream is seeded from (seed, step, its number) just before its forward), so the tests
count how often each micro-batch of the failed step was computed.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from torch import nn

import planaria
from planaria import Job, RunConfig, fit
from planaria.data.randomness import micro_batch_seed
from planaria.examples import mlp
from tests.assertions import assert_exactly_once, assert_same_state, events, of
from tests.loop_faults import AtPhase, arm

# The workers unpickle this module's helpers by value: they cannot import the tests package.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

N, G, MBS, STEPS, KILL_AT = 480, 96, 8, 10, 4
TOTAL = G // MBS  # 12 micro-batches: 4 a rank at 3 replicas


class RecordingLoss:
    """The MLP's loss, which first appends ``pid seed`` to ``path`` (the seed names the
    micro-batch) and sleeps ``slow_s`` on the micro-batches of step ``slow_step``."""

    def __init__(self, path: str, slow_step: int = -1, slow_s: float = 0.0) -> None:
        self.path, self.slow_s = path, slow_s
        self.slow = {micro_batch_seed(0, slow_step, j) for j in range(TOTAL)}

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        seed = torch.initial_seed()
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {seed}\n")
        if seed in self.slow:
            time.sleep(self.slow_s)
        return mlp.mse(model, batch)


class DieAt:
    """At ``step``, in ``phase``: wait ``after_s`` (the peers reach the reduction), then
    SIGKILL this worker (once)."""

    def __init__(self, step: int, marker: str, after_s: float) -> None:
        self.step, self.marker, self.after_s = step, marker, after_s

    def __call__(self, worker: Any, step: int, phase: str) -> None:
        if step == self.step and not os.path.exists(self.marker):
            Path(self.marker).write_text(worker.name)
            time.sleep(self.after_s)
            os.kill(os.getpid(), signal.SIGKILL)


def make_model(dropout: float = 0.0, batch_norm: bool = False) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(32, 64), nn.Tanh()]
    if batch_norm:
        layers.append(nn.BatchNorm1d(64))
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(64, 1))


def make_spec(loss: Any, *, dropout: float = 0.0, batch_norm: bool = False) -> Any:
    base = mlp.make_spec(n=N, global_batch_size=G, micro_batch_size=MBS)
    return replace(base, loss=loss,
                   model=lambda: make_model(dropout=dropout, batch_norm=batch_norm))


def reference(tmp: Path, **model: Any) -> dict:
    spec = make_spec(RecordingLoss(str(tmp / "ref.log")), **model)
    return fit(spec, steps=STEPS, replicas=2, run_dir=tmp / "ref").state_dict


def run_killing(run_dir: Path, *, point: str, after_s: float, slow_s: float = 0.0,
                spares: int = 0, config: dict | None = None,
                **model: Any) -> tuple[planaria.FitResult, Path, dict]:
    """3 replicas; w1 dies at step KILL_AT's ``point`` (``after_s`` later). Returns the
    result, the forward log and the pids of the workers by name (the last members')."""
    log = run_dir / "forwards.log"
    spec = make_spec(RecordingLoss(str(log), KILL_AT, slow_s), **model)
    job = Job(spec, RunConfig(steps=STEPS, replicas=3, run_dir=run_dir, ledger=True,
                              spares=spares, **(config or {})))
    with job:
        if spares:
            assert job.wait_for_spares(timeout_s=180) == spares
        arm(job, "w1", point, AtPhase(DieAt(KILL_AT, str(run_dir / "killed"), after_s),
                                      point.removeprefix("worker.")))
        while job.steps_done < STEPS:
            try:
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        pids = {h.name: h.pid for h in job.members}
        state = job.model_state_dict()
    result = planaria.FitResult(job.steps_done, job.losses, run_dir / "events.jsonl", state,
                                run_dir)
    return result, log, pids


def forwards_of_step(log: Path, step: int) -> dict[int, list[int]]:
    """{micro-batch number: the pids that computed it} for step ``step``."""
    number = {micro_batch_seed(0, step, j): j for j in range(TOTAL)}
    out: dict[int, list[int]] = {j: [] for j in range(TOTAL)}
    for line in log.read_text().splitlines():
        pid, seed = line.split()
        if int(seed) in number:
            out[number[int(seed)]].append(int(pid))
    return out


def check_same_and_once(run_dir: Path, result: planaria.FitResult, ref: dict) -> list[dict]:
    assert result.final_step == STEPS
    assert_same_state(ref, result.state_dict)
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run_dir)
    assert [e["step"] for e in of(evs, "step_failed")] == [KILL_AT]
    return evs


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_a_kill_in_the_reduction_recomputes_only_the_dead_ranks_share(
    tmp_path: Path, dropout: float
) -> None:
    """w1 dies once its gradient is computed, after its peers entered the all-reduce: their
    buffers were touched by the broken collective, and the copy taken before it is kept."""
    ref = reference(tmp_path, dropout=dropout)
    run_dir = tmp_path / "run"
    result, log, _ = run_killing(run_dir, point="worker.computed", after_s=1.0,
                                 dropout=dropout)
    evs = check_same_and_once(run_dir, result, ref)
    (resumed,) = of(evs, "step_resumed")
    assert (resumed["step"], resumed["kept"], resumed["redone"], resumed["total"]) == (
        KILL_AT, 8, 4, TOTAL)
    assert resumed["unstarted"] == 0  # every survivor had finished: only the dead's share
    counts = {j: len(pids) for j, pids in forwards_of_step(log, KILL_AT).items()}
    dead = range(4, 8)  # w1 is rank 1 of 3: micro-batches 4..7
    assert counts == {j: 2 if j in dead else 1 for j in range(TOTAL)}, counts


def test_a_kill_during_the_compute_keeps_what_the_survivors_finished(tmp_path: Path) -> None:
    """w1 dies before its compute while its peers are still computing (slow micro-batches):
    they stop between micro-batches, keep those they finished, and no micro-batch of the
    step is computed twice."""
    ref = reference(tmp_path)
    run_dir = tmp_path / "run"
    result, log, _ = run_killing(run_dir, point="worker.loaded", after_s=0.0, slow_s=0.4)
    evs = check_same_and_once(run_dir, result, ref)
    (resumed,) = of(evs, "step_resumed")
    assert resumed["kept"] + resumed["redone"] == TOTAL and resumed["redone"] >= 4
    assert resumed["kept"] >= 1
    assert resumed["redone"] - resumed["unstarted"] == 4  # lost: the dead rank's share only
    counts = {j: len(pids) for j, pids in forwards_of_step(log, KILL_AT).items()}
    assert counts == dict.fromkeys(range(TOTAL), 1), counts


def test_a_warm_spare_takes_part_of_the_redone_share(tmp_path: Path) -> None:
    ref = reference(tmp_path)
    run_dir = tmp_path / "run"
    result, log, pids = run_killing(run_dir, point="worker.computed", after_s=1.0, spares=1)
    evs = check_same_and_once(run_dir, result, ref)
    (resumed,) = of(evs, "step_resumed")
    assert (resumed["kept"], resumed["redone"]) == (8, 4)
    (taken,) = of(evs, "replacement_requested")
    assert taken["spare"]
    spare_pid = pids[taken["worker"]]
    by_spare = [j for j, ps in forwards_of_step(log, KILL_AT).items() if spare_pid in ps]
    assert by_spare and set(by_spare) <= set(range(4, 8))


def test_a_model_with_batch_norm_recomputes_the_whole_step(tmp_path: Path) -> None:
    """Module buffers (BatchNorm's statistics, composed over contiguous ranges) fall back:
    nothing is kept, the step is computed again whole, and the result is the same."""
    ref = reference(tmp_path, batch_norm=True)
    run_dir = tmp_path / "run"
    result, log, _ = run_killing(run_dir, point="worker.computed", after_s=1.0,
                                 batch_norm=True)
    evs = check_same_and_once(run_dir, result, ref)
    assert not of(evs, "step_resumed")
    counts = forwards_of_step(log, KILL_AT)
    assert all(len(pids) == 2 for pids in counts.values())


def test_the_overlapped_reduction_keeps_each_bucket_as_its_all_reduce_started(
    tmp_path: Path,
) -> None:
    ref = reference(tmp_path)
    run_dir = tmp_path / "run"
    result, log, _ = run_killing(run_dir, point="worker.computed", after_s=1.0,
                                 config={"overlap_reduction": True})
    evs = check_same_and_once(run_dir, result, ref)
    (resumed,) = of(evs, "step_resumed")
    assert (resumed["kept"], resumed["redone"]) == (8, 4)
    counts = {j: len(pids) for j, pids in forwards_of_step(log, KILL_AT).items()}
    assert counts == {j: 2 if j in range(4, 8) else 1 for j in range(TOTAL)}, counts


def test_switched_off_the_whole_step_is_computed_again(tmp_path: Path) -> None:
    ref = reference(tmp_path)
    run_dir = tmp_path / "run"
    result, log, _ = run_killing(run_dir, point="worker.computed", after_s=1.0,
                                 config={"keep_finished_micro_batches": False})
    evs = check_same_and_once(run_dir, result, ref)
    assert not of(evs, "step_resumed")
    assert all(len(pids) == 2 for pids in forwards_of_step(log, KILL_AT).values())
