"""Compiled models: the same training as uncompiled, and a replacement that starts from a
running worker's compile cache (warm) compiles in a fraction of the first workers' time."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import ray

from planaria import ChaosPlan, Failure, Job, RunConfig, fit
from planaria.examples import mlp
from tests.assertions import assert_exactly_once, assert_same_state, events, of

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, G, STEPS = 512, 64, 10


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_compiled_run_equals_an_eager_one_and_its_replacement_starts_warm(
    tmp_path: Path,
) -> None:
    eager = fit(mlp.make_spec(n=N), steps=STEPS, replicas=2, run_dir=tmp_path / "eager")
    spec = dataclasses.replace(mlp.make_spec(n=N), compile=True)
    run = tmp_path / "compiled"
    job = Job(spec, RunConfig(steps=STEPS, replicas=2, run_dir=run, ledger=True),
              chaos=ChaosPlan.parse("kill:w1@step4"))
    with job:
        while job.steps_done < STEPS:
            if job.steps_done == STEPS - 2:
                job.wait_for_width(2, timeout_s=300)  # the replacement joins within the run
            try:
                job.train_step()
            except Failure as failure:
                job.recovery.handle(failure)
        state = job.model_state_dict()
    assert job.steps_done == STEPS
    assert_same_state(eager.state_dict, state)
    assert_exactly_once(run, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run)
    started = {e["worker"]: e for e in of(evs, "worker_started")}
    first, replacement = started["w0"], started["w2"]
    assert first["warm"] is False and replacement["warm"] is True
    assert replacement["compile_s"] < 0.5 * first["compile_s"]
    (cache,) = of(evs, "compile_cache")
    assert cache["bytes"] > 0 and (run / "compile_cache.tar.gz").stat().st_size == cache["bytes"]
    assert of(evs, "joined")[0]["worker"] == "w2"
