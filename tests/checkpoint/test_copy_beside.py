"""A save's copy into staging runs beside the next step (``CheckpointConfig.copy_beside``):
the next update waits for it, so the checkpoint holds its step's state exactly, buffers
(which the next forward changes) included."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from planaria import Job, RunConfig
from planaria.checkpoint import load_checkpoint
from planaria.checkpoint.config import CheckpointConfig
from planaria.examples import bn_mlp
from tests.assertions import assert_exactly_once, events, of, run_to
from tests.loop_faults import arm

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, G, STEPS, EVERY = 512, 64, 8, 4


class CopyOnceTheUpdateWaits:
    """At a worker's ``worker.stage_copy`` point (its staging thread): the copy begins only
    once the worker's training thread waits at the fence with the next update (bounded),
    so every update after the save's step arrives while the copy has not yet read a byte."""

    def __call__(self, *, worker: Any, step: int) -> None:
        fence = worker.state.copy_fence
        end = time.monotonic() + 60
        while not fence.waiting and time.monotonic() < end:
            time.sleep(0.005)
        if not fence.waiting:
            raise AssertionError(f"{worker.name}'s next update never reached the fence")


def state_at(spec: Any, steps: int, run_dir: Path) -> dict[str, torch.Tensor]:
    with Job(spec, RunConfig(steps=steps, replicas=2, run_dir=run_dir)) as job:
        run_to(job, steps)
        tensors, _ = job.state()
    return tensors


@pytest.mark.multiprocess
@pytest.mark.usefixtures("ray_cluster")
def test_the_update_after_a_save_waits_for_its_copy(tmp_path: Path) -> None:
    spec = bn_mlp.make_spec(n=N, global_batch_size=G)
    expected_at_save = state_at(spec, EVERY, tmp_path / "ref-save")
    expected_end = state_at(spec, STEPS, tmp_path / "ref-end")
    run_dir = tmp_path / "run"
    cfg = CheckpointConfig(every=EVERY, copy_beside=True)
    with Job(spec, RunConfig(steps=STEPS, replicas=2, run_dir=run_dir, ledger=True),
             checkpoint=cfg) as job:
        for h in job.members:
            arm(job, h.name, "worker.stage_copy", CopyOnceTheUpdateWaits(), times=1)
        run_to(job, STEPS)
        final, _ = job.state()
    saved, meta = load_checkpoint(str(run_dir / "checkpoints" / f"step_{EVERY:09d}"))
    assert meta["steps_done"] == EVERY
    assert saved.keys() == expected_at_save.keys()
    for name in saved:  # exactly the state of the save's step: no later update leaked in
        assert torch.equal(saved[name], expected_at_save[name]), name
    for name in final:
        assert torch.equal(final[name], expected_end[name]), name
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=STEPS)
    first = next(e for e in of(events(run_dir), "checkpoint_saved") if e["step"] == EVERY)
    assert first["blocked_s"] > 0  # the update waited, and the wait is the save's stall
    assert first["stall_s"] >= first["blocked_s"]
