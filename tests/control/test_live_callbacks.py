"""``fit(on_step=...)`` is called as each step commits, while its run of steps goes on: step 3
waits (bounded) for step 1's callback, in the same run, and records whether it came. Rank 0
publishes a step's record once the next step is applied, at most every ``STREAM_S``: the
steps before step 3 last at least that long each (a micro-batch sleeps ``STREAM_S``). Real
workers."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import pytest
import ray

from planaria import fit
from planaria.examples import mlp
from planaria.worker.run_loop import STREAM_S
from tests.assertions import events, of

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

G, MBS, STEPS = 32, 16, 6


class WaitsForTheFirstCallback:
    """mlp's loss; the micro-batches of step 3 on wait until ``called`` exists (at most
    60 s) and note in ``late`` if it never came."""

    def __init__(self, called: str, late: str) -> None:
        self.called, self.late, self.calls = called, late, 0

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls <= 3 * (G // MBS):  # steps 0-2: as long as the stream's period at least
            time.sleep(STREAM_S)
        if self.calls > 3 * (G // MBS):  # step 3 on (one replica runs every micro-batch)
            end = time.monotonic() + 60
            while not os.path.exists(self.called) and time.monotonic() < end:
                time.sleep(0.01)
            if not os.path.exists(self.called):
                Path(self.late).touch()
        return mlp.mse(model, batch)


def test_on_step_is_called_as_steps_commit_within_the_run(tmp_path):
    called, late = tmp_path / "called", tmp_path / "late"
    spec = dataclasses.replace(mlp.make_spec(n=256, global_batch_size=G, micro_batch_size=MBS),
                               loss=WaitsForTheFirstCallback(str(called), str(late)))
    seen: list[int] = []

    def on_step(result) -> None:
        seen.append(result.step)
        if result.step == 1:
            called.touch()

    fit(spec, steps=STEPS, replicas=1, run_dir=tmp_path / "run", on_step=on_step)
    assert not late.exists(), "step 1's callback came only when its run ended"
    assert seen == list(range(STEPS))
    (run,) = [r for r in of(events(tmp_path / "run"), "run_ahead") if r["start"] <= 1 < r["until"]]
    assert run["until"] > 3  # steps 1 and 3 were one run
