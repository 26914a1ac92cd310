"""Hot spares: a warm standby takes a lost worker's place at once, in the same generation
as the resize (no step at reduced width), and is replenished; a standby that died while
standing by is passed over; a spare still starting becomes the replacement."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray

import planaria
from planaria import ConfigError, Job, RunConfig, fit
from planaria.examples import mlp
from planaria.worker import forkserver
from tests.assertions import assert_exactly_once, assert_same_state, events, of

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, G, STEPS = 512, 64, 16


def test_spares_must_be_a_count(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="spares"):
        RunConfig(steps=1, replicas=2, run_dir=tmp_path, spares=-1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ray_cluster):
    return fit(mlp.make_spec(n=N), steps=STEPS, replicas=2,
               run_dir=tmp_path_factory.mktemp("ref")).state_dict


def run_killing(run_dir: Path, *, kill_spare_first: bool) -> planaria.FitResult:
    """3 replicas and 1 spare; once the spare is warm, w1 is SIGKILLed at step 5's
    boundary (and, with ``kill_spare_first``, the standby itself just before)."""
    job = Job(mlp.make_spec(n=N),
              RunConfig(steps=STEPS, replicas=3, run_dir=run_dir, ledger=True, spares=1))
    with job:
        assert job.wait_for_spares(timeout_s=180) == 1
        while job.steps_done < STEPS:
            if job.steps_done == 5 and "w1" in job.names:
                if kill_spare_first:
                    os.kill(job.pool.standby[0].pid, signal.SIGKILL)
                os.kill(next(h.pid for h in job.members if h.name == "w1"), signal.SIGKILL)
            if job.steps_done == STEPS - 2:
                job.wait_for_width(3, timeout_s=180)  # a cold replacement must join in the run
            try:
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        state = job.model_state_dict()
    return planaria.FitResult(job.steps_done, job.losses, run_dir / "events.jsonl", state, run_dir)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_warm_spare_takes_the_place_with_no_step_at_reduced_width(
    tmp_path: Path, reference
) -> None:
    result = run_killing(tmp_path, kill_spare_first=False)
    assert result.final_step == STEPS
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    (fault,) = of(evs, "fault")
    (taken,) = of(evs, "replacement_requested")
    assert taken["spare"] and taken["worker"] == "w3" and taken["replaces"] == "w1"
    assert [e["width"] for e in of(evs, "step_committed")] == [3] * STEPS  # never short-handed
    assert of(evs, "recovered")[0]["lost_steps"] == 0
    assert [e["worker"] for e in of(evs, "spare_requested")] == ["w3", "w4"]  # replenished
    # the spares' models built without drawing weights: the state sent to w3 is all of it
    inits = {e["worker"]: e["init"] for e in of(evs, "worker_started")}
    assert inits["w0"] == inits["w2"] == "drawn" and inits["w3"] == "skipped"
    (joined,) = of(evs, "joined")
    assert joined["worker"] == "w3" and joined["step"] == fault["step"]
    # One node: every worker, spares included, was forked warm by the fork server.
    started = of(evs, "worker_started")  # w4, the new standby, may still be starting at the end
    assert len(started) >= 4 and all(e["forked"] for e in started)
    # A spare ran a forward and backward before standing by (its first step at the
    # others' speed); the job's first workers did not; the state is the reference's above.
    warm = {e["worker"]: e["warm_s"] for e in started}
    assert all(warm[w] == 0 for w in ("w0", "w1", "w2")) and warm["w3"] > 0, warm
    # ... at the joiners' setup priority (SCHED_IDLE), where the worker may put it back.
    lowered = "idle" if forkserver.may_raise_priority() else "worker"
    assert next(e["warm_priority"] for e in started if e["worker"] == "w3") == lowered


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_spare_that_died_standing_by_is_passed_over(tmp_path: Path, reference) -> None:
    result = run_killing(tmp_path, kill_spare_first=True)
    assert result.final_step == STEPS
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    assert [e["worker"] for e in of(evs, "spare_lost")] == ["w3"]
    (cold,) = of(evs, "replacement_requested")
    assert not cold.get("spare") and cold["replaces"] == "w1"
    assert cold["worker"] != "w3"
    assert of(evs, "joined")


@ray.remote
class _Gate:
    """Counts the model factory's calls; the ones after the first ``hold_after`` wait until
    it is opened (a spare held in its setup, so it is still starting at a kill)."""

    def __init__(self, hold_after: int) -> None:
        self.calls, self.hold_after, self.opened = 0, hold_after, asyncio.Event()

    async def enter(self) -> None:
        self.calls += 1
        if self.calls > self.hold_after:
            await self.opened.wait()

    async def open(self) -> None:
        self.opened.set()


class _GatedModel:
    def __init__(self, model: Callable[[], Any], gate: str) -> None:
        self.model, self.gate = model, gate

    def __call__(self) -> Any:
        ray.get(ray.get_actor(self.gate).enter.remote())
        return self.model()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_replacement_takes_the_spare_still_starting(tmp_path: Path, reference) -> None:
    """w1 dies while the spare w3 is still in its setup: w3 becomes w1's replacement (no
    second worker starts beside it), the job goes on at width 2 until w3 is ready, and
    the next spare starts only once w3 is handed over."""
    name = f"gate-{uuid.uuid4().hex[:8]}"
    gate = _Gate.options(name=name).remote(3)  # w0, w1, w2 pass; the spare waits
    spec = mlp.make_spec(n=N)
    spec = dataclasses.replace(spec, model=_GatedModel(spec.model, name))
    job = Job(spec, RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True, spares=1))
    opened = False
    with job:
        assert job.pool.spares_starting == 1 and not job.pool.standby
        while job.steps_done < STEPS:
            if job.steps_done == 5 and "w1" in job.names:
                os.kill(next(h.pid for h in job.members if h.name == "w1"), signal.SIGKILL)
            adopted = any(h.name == "w3" and h.replaces == "w1" for h in job.pool.starting)
            if adopted and not opened:
                ray.get(gate.open.remote())
                opened = True
            if job.steps_done == STEPS - 2:
                job.wait_for_width(3, timeout_s=180)
            try:
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        state = job.model_state_dict()
    assert opened
    assert_same_state(reference, state)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    (asked,) = of(evs, "replacement_requested")
    assert (asked["worker"], asked["replaces"], asked["spare"], asked["starting"]) == (
        "w3", "w1", True, True)
    (ready,) = of(evs, "replacement_ready")
    assert ready["worker"] == "w3" and ready["spare"] is True
    spares = of(evs, "spare_requested")
    assert [e["worker"] for e in spares] == ["w3", "w4"]
    assert spares[1]["t"] >= ready["t"]  # the next standby waited for the replacement
    assert {e["worker"] for e in of(evs, "worker_started")} <= {"w0", "w1", "w2", "w3", "w4"}
    assert 2 in {e["width"] for e in of(evs, "step_committed")}  # short-handed meanwhile
    assert [e["worker"] for e in of(evs, "joined")] == ["w3"]
