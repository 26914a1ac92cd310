"""Recovery at real step lengths (seconds), where busy must never be mistaken for hung.

Each step here takes ~2-3 s (the loss sleeps per micro-batch, so the worker is
busy in the step as real compute keeps it). A fault must cost only the faulty
worker: every healthy survivor stays, no step is lost, the final weights equal
a fault-free run's and every sample is used exactly once.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import ray

import planaria
from planaria import HangConfig, Job, RunConfig, fit
from planaria.examples import mlp
from tests.assertions import assert_exactly_once, assert_same_state, events, of

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

N, G, STEPS = 512, 64, 4
MICRO_S = 3.0  # each micro-batch takes at least this long: 2 per rank at width 3, a 6 s step


class SlowLoss:
    """mse, but each call takes at least ``seconds``: a long step without changing the math."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, model, batch):
        end = time.monotonic() + self.seconds
        loss = mlp.mse(model, batch)
        while time.monotonic() < end:
            time.sleep(0.01)
        return loss


def slow_spec() -> planaria.TrainSpec:
    base = mlp.make_spec(n=N)
    return planaria.TrainSpec(
        model=base.model,
        optimizer=base.optimizer,
        loss=SlowLoss(MICRO_S),
        dataset=base.dataset,
        global_batch_size=G,
        micro_batch_size=16,
        grad_clip_norm=base.grad_clip_norm,
        seed=base.seed,
        name="slow-mlp",
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ray_cluster):
    return fit(
        mlp.make_spec(n=N), steps=STEPS, replicas=2, run_dir=tmp_path_factory.mktemp("ref")
    ).state_dict


def run(run_dir: Path, chaos: str, hang: HangConfig | None = None) -> dict:
    job = Job(
        slow_spec(),
        RunConfig(steps=STEPS, replicas=3, run_dir=run_dir, ledger=True),
        chaos=planaria.ChaosPlan.parse(chaos),
        hang=hang,
    )
    with job:
        while job.steps_done < STEPS:
            try:
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        return job.model_state_dict()


def evicted(evs: list[dict]) -> set[str]:
    """Every worker that left the membership through a fault or a drain."""
    out: set[str] = set()
    for e in of(evs, "fault"):
        out |= set((e.get("worker") or "").split(",")) - {""}
    return out


def check(run_dir: Path, state: dict, reference: dict, *, faulted: set[str]) -> list[dict]:
    assert_same_state(reference, state)
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run_dir)
    assert evicted(evs) == faulted, "a healthy worker was evicted"
    assert not of(evs, "restore"), "no replica should have lost its state"
    assert all(r["lost_steps"] == 0 for r in of(evs, "recovered"))
    return evs


def test_kill_in_a_long_step_costs_only_the_dead_worker(tmp_path, reference):
    state = run(tmp_path, "kill:w1@step2")
    evs = check(tmp_path, state, reference, faulted={"w1"})
    fault = of(evs, "fault")[0]
    assert fault["kind"] == "worker_lost"
    # The survivors abandon the step between micro-batches: detection plus recovery is
    # about one micro-batch plus the re-run, not a step plus a grace period.
    rec = of(evs, "recovered")[0]
    step_s = max(e["duration_s"] for e in of(evs, "step_committed") if e["width"] == 3)
    assert rec["recover_s"] < MICRO_S + 2 * step_s


@pytest.mark.extended
def test_hang_in_a_long_step_evicts_only_the_stopped_worker(tmp_path, reference):
    hang = HangConfig(heartbeat_s=0.1, heartbeat_timeout_s=1.5)
    state = run(tmp_path, "hang:w0@step2", hang=hang)
    evs = check(tmp_path, state, reference, faulted={"w0"})
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_hung"]
    assert of(evs, "hang_stack")[0]["worker"] == "w0"
