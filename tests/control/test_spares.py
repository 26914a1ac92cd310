"""Hot spares: a warm standby takes a lost worker's place at once, in the same generation
as the resize (no step at reduced width), and is replenished; a standby that died while
standing by is passed over."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

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
