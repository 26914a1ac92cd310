"""The fault-free runtime on real Ray with real worker processes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import ray

from planaria import Job, RunConfig, StepResult, fit
from planaria.examples import mlp, tiny_gpt
from planaria.faults.errors import StaleGeneration
from tests.assertions import assert_exactly_once, assert_same_state

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("ray_cluster")]


def test_mlp_loss_falls_and_one_replica_equals_three(tmp_path):
    spec = mlp.make_spec(n=512)
    one = fit(spec, steps=24, replicas=1, run_dir=tmp_path / "one")
    three = fit(spec, steps=24, replicas=3, run_dir=tmp_path / "three", ledger=True)
    assert three.final_step == 24
    first = np.mean([loss for _, loss in three.losses[:4]])
    last = np.mean([loss for _, loss in three.losses[-4:]])
    assert last < 0.7 * first
    # Same spec and seed: the same parameters whatever the width (up to summation order).
    assert_same_state(one.state_dict, three.state_dict, atol=1e-6, rtol=1e-5)
    # 24 steps x 64 = 1536 samples = 3 epochs of 512: every sample exactly once per epoch.
    assert_exactly_once(tmp_path / "three", num_samples=512, global_batch_size=64, steps=24)
    events = [json.loads(line) for line in three.events_path.read_text().splitlines()]
    names = [e["event"] for e in events]
    assert names[0] == "run_start" and names[-1] == "run_end"
    assert names.count("step_committed") == 24
    assert {e["width"] for e in events if e["event"] == "step_committed"} == {3}


@pytest.mark.extended
@pytest.mark.slow
def test_tiny_gpt_loss_falls(tmp_path):
    spec = tiny_gpt.make_spec(dim=64, layers=2, global_batch_size=24, micro_batch_size=8, lr=1e-2)
    seen: list[StepResult] = []
    result = fit(spec, steps=30, replicas=3, run_dir=tmp_path, on_step=seen.append)
    assert len(seen) == 30 and seen[0].width == 3
    assert "bits_per_byte" in seen[0].metrics
    assert np.mean([x for _, x in result.losses[-5:]]) < result.losses[0][1] - 1.0
    held_out = tiny_gpt.evaluate(result.state_dict, dim=64, layers=2, batches=2)
    assert held_out < result.losses[0][1]


def test_older_generation_is_refused_and_changes_nothing(tmp_path):
    spec = mlp.make_spec(n=256)
    with Job(spec, RunConfig(steps=4, replicas=2, run_dir=tmp_path)) as job:
        job.train_step()
        job.train_step()
        before = job.checksums()
        old_gen = job.gen
        job.build_generation(job.members, reason="resize")  # generation moves on
        w0 = job.members[0]
        assert job.plan is not None
        plan = (job.plan.num_samples, job.plan.global_batch_size, job.plan.seed)
        start = job.steps_done
        with pytest.raises(StaleGeneration, match="refused"):
            ray.get(w0.actor.run.remote(old_gen, 99, start, start + 1, plan=plan))
        with pytest.raises(StaleGeneration):
            ray.get(w0.actor.commit.remote(old_gen, job.steps_done))
        assert job.checksums() == before
        job.train_step()  # the job itself goes on
        assert job.steps_done == 3
