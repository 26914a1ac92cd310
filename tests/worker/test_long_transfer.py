"""A state transfer longer than the collective timeout is busy, not hung.

A 30 GB shard on 1 GbE takes minutes: a joiner's state transfer is judged by its bytes
moving, and its deadline grows with them. Here the source's link is slowed (each 32 MB
window of its send waits 0.8 s) so that the transfer of ~100 MB takes several times the
collective timeout: the source and the joiner must both stay, the joiner join, and the
training equal a fault-free run's.
"""

from __future__ import annotations

import sys
import time

import pytest
import ray
import torch

import planaria
from planaria import Job, RunConfig
from planaria.examples import mlp
from tests.assertions import assert_exactly_once, assert_same_state, events, of
from tests.assertions import run_to as drive

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

N, G, MBS, STEPS = 256, 48, 8, 6


def big_spec() -> planaria.TrainSpec:
    base = mlp.make_spec(n=N, global_batch_size=G, micro_batch_size=MBS)
    return planaria.TrainSpec(
        model=lambda: mlp.make_model(hidden=2900),  # ~8.5 M parameters: ~100 MB with Adam
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), loss=base.loss,
        dataset=base.dataset, global_batch_size=G, micro_batch_size=MBS, seed=0,
    )


def slow_link(worker) -> None:
    """This worker's sends go one 32 MB window at a time, 0.8 s apart (a slow link)."""
    import planaria.worker.collective as collective

    collective.WINDOW = 1
    moved = worker.vitals.bytes_moved

    def slowly(n: int) -> None:
        time.sleep(0.8)
        moved(n)

    worker.vitals.bytes_moved = slowly




def test_a_transfer_longer_than_the_collective_timeout_keeps_its_source(tmp_path):
    with Job(big_spec(), RunConfig(steps=STEPS, replicas=2, run_dir=tmp_path / "ref")) as ref:
        reference = drive(ref, STEPS)
    run = tmp_path / "run"
    config = RunConfig(steps=STEPS, replicas=2, run_dir=run, ledger=True,
                       collective_timeout_s=2.0, min_transfer_bytes_per_s=1e12,
                       state_beside_step=False,  # the whole state before the step
                       state_by_memory=False)  # over the group, whose link is slowed
    job = Job(big_spec(), config, chaos=planaria.ChaosPlan.parse("kill:w1@step2"))
    with job:
        source = next(h for h in job.members if h.name == "w0")
        ray.get(source.actor.__ray_call__.remote(lambda self: slow_link(self)))
        drive(job, 4)
        assert job.wait_for_width(2, timeout_s=180) == 2
        state = drive(job, STEPS)
    assert_same_state(reference, state)
    assert_exactly_once(run, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run)
    transfer = of(evs, "state_transfer")[0]
    assert transfer["seconds"] > 2 * config.collective_timeout_s  # slow, as arranged
    assert [f["worker"] for f in of(evs, "fault")] == ["w1"]  # the source stayed
    assert not of(evs, "hang_stack")
