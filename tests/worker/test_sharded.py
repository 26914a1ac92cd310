"""Sharded replicas (planaria.worker.sharded, planaria.worker.replica): 2 replicas x 2 workers,
FSDP2 inside a replica, planaria's elastic groups across replicas, the replica the unit of
failure.

A tiny transformer (LayerNorm, attention, dropout, AdamW, a warm-up schedule, clipping)
trained 2 x 2 must end with the weights one worker gets on the whole batch, every sample
served once; a worker killed, stopped or preempted takes its whole replica out, the other
goes on at half the width with the same global batch, a replacement replica of two workers
joins and receives its shards, and the weights are still the fault-free ones.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import ray

import planaria
from planaria import Job, RunConfig, fit
from planaria.examples import tiny_gpt
from planaria.faults.errors import ConfigError
from planaria.fit import _finish as finish
from tests.assertions import assert_exactly_once, assert_same_state, events, of
from tests.loop_faults import SignalSelfAt, install

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS, FAULT_STEP = 10, 4
G = 24  # 6 micro-batches of 4: 2 x 2 workers run 2, 1 (padded to 2), 2, 1; 1 x 2 run 3, 3
N = 2400  # samples in the tiny_gpt dataset are windows; the plan draws from all of them


# Float tolerance: the shards' sums are reduced in another order than one worker's, and AdamW
# turns a gradient component near zero into an lr-sized step of either sign (a wrong gradient
# moves the weights by ~lr = 1e-3 here).
ATOL = 1e-4


def spec() -> planaria.TrainSpec:
    # Dropout: its masks are seeded per micro-batch (its index in the global batch), so a
    # sharded replica's workers, a re-run after a fault and one worker draw the same ones.
    return tiny_gpt.make_spec(dim=32, layers=2, global_batch_size=G, dropout=0.1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ray_cluster):
    """One replica of one worker: the whole model on the whole batch."""
    return fit(spec(), steps=STEPS, replicas=1, run_dir=tmp_path_factory.mktemp("ref")).state_dict


def _num_samples() -> int:
    return len(tiny_gpt.CharWindows())


def test_two_replicas_of_two_workers_equal_one_worker(tmp_path, reference):
    result = fit(spec(), steps=STEPS, replicas=2, workers_per_replica=2, run_dir=tmp_path,
                 ledger=True)
    assert_same_state(reference, result.state_dict, atol=ATOL)
    assert_exactly_once(tmp_path, num_samples=_num_samples(), global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    assert [e["step"] for e in of(evs, "step_committed")] == list(range(STEPS))
    assert of(evs, "run_ahead"), "the autonomous loop ran"


def _run_with_fault(
    tmp_path: Path, worker: str, phase: str, signum: int, spares: int = 0
) -> tuple[dict, list]:
    marker = str(tmp_path / "fired")
    run_dir = tmp_path / "run"
    config = RunConfig(steps=STEPS, replicas=2, workers_per_replica=2, run_dir=run_dir,
                       ledger=True, spares=spares)
    with Job(spec(), config) as job:
        if spares:
            job.pool.replenish()
            while not job.pool.standby:  # the spare replica stands by before the fault
                job.pool.poll(timeout_s=1.0)
        job.run_steps(1)  # the first step, alone: the metrics are named
        install(job, worker, SignalSelfAt(FAULT_STEP, phase, signum, marker))
        while job.steps_done < STEPS:
            try:
                if job.steps_done == STEPS - 2:
                    job.wait_for_width(2, timeout_s=180)  # the replacement replica joins
                job.run_steps(STEPS - 2 if job.steps_done < STEPS - 2 else STEPS)
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        state = finish(job)
    assert Path(marker).read_text() == worker
    assert_exactly_once(run_dir, num_samples=_num_samples(), global_batch_size=G, steps=STEPS)
    evs = events(run_dir)
    assert [e["step"] for e in of(evs, "step_committed")] == list(range(STEPS))
    return state, evs


@pytest.mark.parametrize(("worker", "phase", "signum", "kind"), [
    ("w1.1", "computed", signal.SIGKILL, "worker_lost"),
    pytest.param("w0", "loaded", signal.SIGKILL, "worker_lost",  # as a one-worker replica's
                 marks=pytest.mark.extended),
    pytest.param("w1.1", "applied", signal.SIGSTOP, "worker_hung", marks=pytest.mark.extended),
    # Stopped before its replica's reduction across replicas: its leader waits there on a
    # peer, never stuck in its own work; the follower's own heartbeat names it.
    ("w1.1", "computed", signal.SIGSTOP, "worker_hung"),
    pytest.param("w1.1", "loaded", signal.SIGTERM, "preempted", marks=pytest.mark.extended),
], ids=["kill-follower", "kill-leader", "hang-follower", "hang-follower-before-reduce",
        "preempt-follower"])
def test_a_fault_of_one_worker_takes_its_replica_out(tmp_path, reference, worker, phase,
                                                     signum, kind):
    """One worker of a 2 x 2 job fails: its replica leaves as one (the controller sees its
    leader), the other replica goes on alone with the global batch unchanged, a replacement
    replica of two workers joins and receives its shards; no step lost, the fault-free
    weights, every sample once."""
    state, evs = _run_with_fault(tmp_path, worker, phase, signum)
    assert_same_state(reference, state, atol=ATOL)
    replica = worker.partition(".")[0]
    faults = of(evs, "fault")
    assert [f["kind"] for f in faults] == [kind]
    assert faults[0]["worker"] == replica
    assert all(r["lost_steps"] == 0 for r in of(evs, "recovered"))
    assert of(evs, "joined"), "a replacement replica joined"


SAVED = 6  # the 2 x 2 job's checkpoint: every 3 steps, the last at step 6


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory, ray_cluster):
    """A 2 x 2 job's checkpoints (steps 3 and 6) and its final weights (gathered whole)."""
    from planaria.checkpoint.config import CheckpointConfig

    run_dir = tmp_path_factory.mktemp("saved")
    result = fit(spec(), steps=SAVED, replicas=2, workers_per_replica=2, run_dir=run_dir,
                 checkpoint=CheckpointConfig(every=3), ledger=True)
    return run_dir / "checkpoints", result.state_dict


def test_a_sharded_checkpoint_holds_the_whole_model(tmp_path, sharded_checkpoint):
    """Each shard saved once (2 x 2 workers: four files, every replica writing half of its
    shard index's rows); exported, the whole model the job ended with."""
    from safetensors.torch import load_file

    from planaria.checkpoint import list_checkpoints, read_manifest, verify_checkpoint
    from planaria.checkpoint.cli import export

    root, state = sharded_checkpoint
    last = [c for c in list_checkpoints(str(root)) if c.committed][-1]
    assert last.step == SAVED
    manifest = read_manifest(last.path)
    assert len(manifest.files) == 4
    assert manifest.meta["workers_per_replica"] == 2
    assert verify_checkpoint(last.path).ok
    sliced = [n for n, t in manifest.tensors.items() if len(t.slices) > 1]
    assert sliced, "the sharded tensors are stored as row slices of the whole"
    out = export(last.path, str(tmp_path / "model.safetensors"))
    weights = load_file(out["out_file"])
    assert sorted(weights) == sorted(state)
    for name, tensor in state.items():
        assert weights[name].shape == tensor.shape
        assert weights[name].equal(tensor), name


@pytest.mark.extended  # about 45 s each; the suite keeps the export of the same checkpoint
@pytest.mark.parametrize(("replicas", "k"), [(2, 1), (1, 2), (1, 4)],
                         ids=["into-2x1", "into-1x2", "into-1x4"])
def test_a_sharded_checkpoint_restores_at_another_k(tmp_path, reference, sharded_checkpoint,
                                                     replicas, k):
    """The 2 x 2 job's checkpoint at step 6, restored into 2 one-worker replicas, one replica
    of 2 and one of 4 workers (each worker reads its rows of the whole tensors), trains on
    to step 10 and ends with the fault-free weights."""
    import shutil

    from planaria.checkpoint.config import CheckpointConfig

    root, _ = sharded_checkpoint
    shutil.copytree(root, tmp_path / "checkpoints")
    result = fit(spec(), steps=STEPS, replicas=replicas, workers_per_replica=k,
                 run_dir=tmp_path, checkpoint=CheckpointConfig(resume=True))
    assert_same_state(reference, result.state_dict, atol=ATOL)
    evs = events(tmp_path)
    restored = of(evs, "restore")
    assert [r["step"] for r in restored] == [SAVED]
    assert [e["step"] for e in of(evs, "step_committed")] == list(range(SAVED, STEPS))


@pytest.mark.extended
def test_a_lone_sharded_replica_lost_is_restored_from_its_checkpoint(tmp_path, reference):
    """One replica of two workers, checkpoints every 3 steps: a kill of its second worker
    at step 7 (step 6 committed, the save of step 6 too) leaves no replica holding the
    state; a new replica of two workers restores the newest committed checkpoint in the
    same process (each worker its shards), re-runs the lost steps, and ends with the
    fault-free weights, every sample served once."""
    from planaria.checkpoint.config import CheckpointConfig

    marker = str(tmp_path / "fired")
    run_dir = tmp_path / "run"
    config = RunConfig(steps=STEPS, replicas=1, workers_per_replica=2, run_dir=run_dir,
                       ledger=True)
    with Job(spec(), config, checkpoint=CheckpointConfig(every=3)) as job:
        job.run_steps(1)
        install(job, "w0.1", SignalSelfAt(7, "computed", signal.SIGKILL, marker))
        # Inside a run, rank 0 reports a step once the next one's reduction shows every rank
        # applied it: a death at step 7 in a run from step 6 would take step 6 before it was
        # committed (nothing lost). The run that dies starts at step 7, with step 6 and the
        # save of step 6 committed: a committed step is lost and runs again.
        while job.steps_done < 7:
            job.run_steps(7)
        job.checkpointer.finish_inflight()
        assert job.checkpointer.last_committed == 6
        while job.steps_done < STEPS:
            try:
                job.run_steps(STEPS)
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        state = finish(job)
    assert Path(marker).read_text() == "w0.1"
    assert_same_state(reference, state, atol=ATOL)
    assert_exactly_once(run_dir, num_samples=_num_samples(), global_batch_size=G, steps=STEPS)
    evs = events(run_dir)
    fault = of(evs, "fault")
    assert [f["kind"] for f in fault] == ["worker_lost"]
    committed = [e["step"] for e in of(evs, "checkpoint_saved") if e["t"] < fault[0]["t"]]
    assert committed, "a checkpoint committed before the fault"
    restored = of(evs, "restore")
    assert [r["step"] for r in restored] == [committed[-1]]
    assert restored[0]["lost_steps"] > 0  # the steps since that checkpoint, run again


class _KillFollowerDuringSave:
    """At the save of step ``step``, once its writers started: SIGKILL replica ``w1``'s
    second worker (its pid from the leader's setup answer)."""

    def __init__(self, step: int) -> None:
        self.step, self.fired = step, False

    def __call__(self, job: Job, phase: str, **info: Any) -> None:
        if phase == "save" and job.steps_done == self.step and not self.fired:
            self.fired = True
            handle = next(h for h in job.members if h.name == "w1")
            os.kill(handle.follower_pids[0], signal.SIGKILL)


@pytest.mark.extended
def test_a_worker_killed_during_a_sharded_save(tmp_path, reference):
    """A worker of a 2 x 2 job killed while the replicas write the step-6 checkpoint: that
    save is not committed (a shard is missing); the other replica goes on and saves step 6
    again alone, a replacement joins, the next saves commit (each verifies), and the
    weights are the fault-free ones."""
    from planaria.checkpoint import list_checkpoints, verify_checkpoint
    from planaria.checkpoint.config import CheckpointConfig

    run_dir = tmp_path / "run"
    config = RunConfig(steps=STEPS, replicas=2, workers_per_replica=2, run_dir=run_dir,
                       ledger=True)
    hook = _KillFollowerDuringSave(6)
    with Job(spec(), config, checkpoint=CheckpointConfig(every=3, keep_last=None)) as job:
        job.hooks.append(hook)
        while job.steps_done < STEPS:
            try:
                if job.steps_done == STEPS - 2:
                    job.wait_for_width(2, timeout_s=180)
                job.run_steps(STEPS - job.steps_done)
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        state = finish(job)
    assert hook.fired
    assert_same_state(reference, state, atol=ATOL)
    assert_exactly_once(run_dir, num_samples=_num_samples(), global_batch_size=G, steps=STEPS)
    evs = events(run_dir)
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_lost"]
    assert 6 in [e["step"] for e in of(evs, "checkpoint_failed")]
    assert not of(evs, "restore"), "the surviving replica held the state"
    saved = of(evs, "checkpoint_saved")
    assert [e["step"] for e in saved] == [3, 6, 9, STEPS]
    failed_t = next(e["t"] for e in of(evs, "checkpoint_failed") if e["step"] == 6)
    assert saved[1]["t"] > failed_t and saved[1]["writers"] == 1  # saved again, by the survivor
    for c in list_checkpoints(str(run_dir / "checkpoints")):
        assert c.committed and verify_checkpoint(c.path).ok


def test_sharded_replicas_refuse_what_they_do_not_support(tmp_path):
    with pytest.raises(ConfigError, match="fewer than the 8 workers"):
        Job(spec(), RunConfig(steps=2, replicas=4, workers_per_replica=2, run_dir=tmp_path))
    with pytest.raises(ConfigError, match="placement"):
        RunConfig(steps=2, replicas=2, workers_per_replica=2, run_dir=tmp_path,
                  placement="spread")


@pytest.mark.extended  # the suite's spare tests cover the pool; this, a replica as a spare
def test_a_spare_replica_takes_the_place_of_a_lost_one(tmp_path, reference):
    """With a spare, the lost replica's place goes to a standby replica of two workers, set
    up ahead (its own FSDP group built, optimizer state made), which receives its shards."""
    state, evs = _run_with_fault(tmp_path, "w1.1", "computed", signal.SIGKILL, spares=1)
    assert_same_state(reference, state, atol=ATOL)
    requested = of(evs, "replacement_requested")
    assert requested and requested[0].get("spare") is True
    assert of(evs, "joined")

