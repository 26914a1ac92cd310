"""Faults during recovery and at the edges of a run: each ends recovered, never with an
uncaught exception, and the final state equals a fault-free run with exactly-once data."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import ray
import torch

import planaria
from planaria import Job, RecoveryPolicy, fit
from planaria.examples import mlp
from planaria.faults import points
from planaria.fit import _finish as finish
from tests.assertions import (
    assert_exactly_once,
    assert_same_state,
    drive,
    events,
    of,
    run_to,
)
from tests.loop_faults import arm

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

N, G, STEPS = 512, 64, 16


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ray_cluster):
    return fit(
        mlp.make_spec(n=N), steps=STEPS, replicas=2, run_dir=tmp_path_factory.mktemp("ref")
    ).state_dict


def test_every_member_preempted_at_once_keeps_the_state(tmp_path, reference):
    job = Job(
        mlp.make_spec(n=N),
        planaria.RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True),
        chaos=planaria.ChaosPlan.parse("preempt:w0@step4,preempt:w1@step4,preempt:w2@step4"),
    )
    with job:
        while job.steps_done < STEPS:
            if job.steps_done == STEPS - 3:  # let the replacements take the state from w2
                job.wait_for_width(3, timeout_s=180)
            job.train_step()  # a preemption never fails a step: no recovery needed here
        state = job.model_state_dict()
    assert_same_state(reference, state)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    assert not of(evs, "restore"), "the state must never have left the job"
    assert not of(evs, "step_failed")
    assert {e["worker"] for e in of(evs, "drained")} == {"w0", "w1", "w2"}


def test_a_death_after_the_last_committed_step(tmp_path, reference):
    killed: list[str] = []

    def kill_one_before_the_end_s_commit(*, membership):
        # every worker applies the committed steps: the end's
        if membership.commit_log.steps_done == STEPS and not killed:
            victim = membership.members[1]
            killed.append(victim.name)
            os.kill(victim.pid, signal.SIGKILL)

    with points.armed("membership.commit_all", kill_one_before_the_end_s_commit):
        result = fit(mlp.make_spec(n=N), steps=STEPS, replicas=3, run_dir=tmp_path,
                     ledger=True)
    assert killed
    assert result.final_step == STEPS
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    assert [f["kind"] for f in of(events(tmp_path), "fault")] == ["worker_lost"]


def _loss_with_nan_gradient(model, batch):
    """mse; on a batch holding the marked sample, the gradient is NaN while the loss is not
    (d sqrt(u)/du at u = 0 is infinite, times 0)."""
    x, y = batch
    loss = mlp.mse(model, batch)
    if bool((y > 100).any()):
        out = model(x)
        loss = loss + 0.0 * torch.sqrt((out - out.detach()).pow(2).sum())
    return loss


class _Marked(mlp.Regression):
    def __init__(self) -> None:
        super().__init__(n=N)
        self.y[11] = 1000.0


def test_nonfinite_gradient_is_caught_and_skip_never_loops(tmp_path):
    spec = planaria.TrainSpec(
        model=mlp.make_model,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        loss=_loss_with_nan_gradient,
        dataset=_Marked,
        global_batch_size=G,
        micro_batch_size=16,
        seed=0,
    )
    policy = RecoveryPolicy(on_nonfinite="skip")
    result = fit(spec, steps=STEPS, replicas=2, run_dir=tmp_path, policy=policy, ledger=True)
    evs = events(tmp_path)
    skipped = of(evs, "step_skipped")
    assert len(skipped) == STEPS * G // N  # the marked sample's step, once in each epoch
    assert all(e["reason"] == "nonfinite_loss" for e in skipped)
    assert result.final_step == STEPS
    # The skipped steps' samples were consumed, not trained: the ledger says so, and every
    # sample is still used (trained or skipped) exactly once per epoch.
    from planaria.data.plan import Ledger

    assert sorted(Ledger.skipped(tmp_path)) == [e["step"] for e in skipped]
    assert not set(Ledger.committed(tmp_path)) & {e["step"] for e in skipped}
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    for value in result.state_dict.values():
        assert bool(torch.isfinite(value).all())
    assert of(evs, "run_end")[0]["status"] == "ok"


class _LossWithStorageHiccup:
    """mse; the first worker to claim ``marker`` (an atomic rename) raises an OSError, as a
    network file system does under the user's data loading."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __call__(self, model, batch):
        try:
            os.rename(self.marker, self.marker + ".claimed")
        except FileNotFoundError:
            return mlp.mse(model, batch)
        raise OSError(116, "Stale file handle")


def test_a_transient_infrastructure_error_under_user_code_reruns_the_step_elsewhere(
    tmp_path, reference
):
    marker = tmp_path / "hiccup"
    base = mlp.make_spec(n=N)
    spec = planaria.TrainSpec(
        model=base.model,
        optimizer=base.optimizer,
        loss=_LossWithStorageHiccup(str(marker)),
        dataset=base.dataset,
        global_batch_size=G,
        micro_batch_size=16,
        grad_clip_norm=base.grad_clip_norm,
    )

    armed: list[int] = []

    def arm(job) -> None:  # once, before step 5 runs (train_step: a run of one step)
        if job.steps_done == 5 and not armed:
            armed.append(5)
            marker.write_text("1")

    run_dir = tmp_path / "run"
    with Job(spec, planaria.RunConfig(steps=STEPS, replicas=3, run_dir=run_dir,
                                      ledger=True)) as job:
        drive(job, STEPS, before=arm)
        state = finish(job)
    assert (tmp_path / "hiccup.claimed").exists()
    assert_same_state(reference, state)
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run_dir)
    faults = of(evs, "fault")
    assert [f["kind"] for f in faults] == ["infrastructure_error"]
    # A first failure of its kind blames no one yet (planaria.control.attribution): the step runs
    # again with its work on another worker, and nobody is replaced.
    assert [a["action"] for a in of(evs, "action")] == ["retry_elsewhere"]
    assert not of(evs, "replacement_requested")
    assert {g["world_size"] for g in of(evs, "generation")} == {3}
    assert of(evs, "run_end")[0]["status"] == "ok"


def test_a_death_during_a_new_generations_rendezvous_does_not_stall_it(tmp_path, reference):
    killed: list[str] = []

    def kill_the_joiner_first(*, recovery, ready):
        if not killed and ready:
            killed.append(ready[0].name)
            os.kill(ready[0].pid, signal.SIGKILL)

    job = Job(
        mlp.make_spec(n=N),
        planaria.RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True),
        chaos=planaria.ChaosPlan.parse("kill:w1@step3"),
    )
    with job, points.armed("recovery.admit", kill_the_joiner_first):
        while job.steps_done < STEPS:
            try:
                if job.steps_done == STEPS - 3:
                    job.wait_for_width(3, timeout_s=180)
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        assert job.width <= 3
        assert not job.recovery.open_work()  # the dead joiner leaves no join open for good
        state = job.model_state_dict()
    assert killed == ["w3"]
    assert_same_state(reference, state)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    assert [f["worker"] for f in of(evs, "fault")] == ["w1", "w3"]
    # The survivors, waiting for w3 at the rendezvous, were released at once (abort/<gen>),
    # not after the 60 s join deadline.
    fault_t = of(evs, "fault")[1]["t"]
    next_gen = next(e for e in of(evs, "generation") if e["t"] > fault_t)
    assert next_gen["t"] - fault_t < 15
    assert max(e["width"] for e in of(evs, "step_committed")) <= 3


def test_a_death_during_a_restore_restores_again(tmp_path, reference):
    from planaria.checkpoint.config import CheckpointConfig

    killed: list[str] = []

    def kill_one_reader(job, phase, **info):
        if phase == "restore" and not killed:
            victim = job.members[-1]
            killed.append(victim.name)
            os.kill(victim.pid, signal.SIGKILL)

    job = Job(
        mlp.make_spec(n=N),
        planaria.RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True),
        # The restore waits for all three replacements: one reader dies, two survive it.
        policy=RecoveryPolicy(min_replicas=3),
        chaos=planaria.ChaosPlan.parse("kill:w0@step8,kill:w1@step8,kill:w2@step8"),
        checkpoint=CheckpointConfig(every=3, fsync=False),
    )
    job.hooks.append(kill_one_reader)
    waited = False
    with job:
        while job.steps_done < STEPS:
            if job.steps_done == 8 and not waited:  # step 6's background save commits first
                job.checkpointer.finish_inflight()
                assert job.checkpointer.last_committed == 6
                waited = True
            try:
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        state = job.model_state_dict()
    assert killed, "the restore never read"
    assert_same_state(reference, state)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    faults = of(evs, "fault")
    assert [f["kind"] for f in faults] == ["all_replicas_lost", "worker_lost"]
    assert faults[1]["worker"] == killed[0]
    # The second fault interrupted the reads, leaving the others' tensors half overwritten:
    # the state was restored again, never resized onto them.
    assert [a["action"] for a in of(evs, "action")] == ["restore", "restore"]
    # Restored from the newest committed checkpoint, at the full width.
    (restore,) = of(evs, "restore")
    committed = [c["step"] for c in of(evs, "checkpoint_saved") if c["t"] <= restore["t"]]
    assert committed == [3, 6] and restore["step"] == 6 and restore["width"] == 3


class _NanOnceOnSample:
    """mse; the first micro-batch holding sample ``index`` whose worker claims ``marker``
    (an atomic rename) gives a NaN loss: one non-finite step, at a step the data plan names."""

    def __init__(self, index: int, marker: str) -> None:
        self.row = mlp.Regression(n=N).x[index]
        self.marker = marker

    def __call__(self, model, batch):
        loss = mlp.mse(model, batch)
        if not bool((batch[0] == self.row).all(dim=1).any()):
            return loss
        try:
            os.rename(self.marker, self.marker + ".claimed")
        except FileNotFoundError:
            return loss
        return loss * float("nan")


class WritesAfterTheRollback:
    """At a worker's shard writes (its ``worker.shard_write`` point, on its writer thread):
    wait (bounded) until the run's event log records the rollback, so the save before the
    non-finite step is in flight at the rollback."""

    def __init__(self, events_path: str) -> None:
        self.events_path = events_path

    def rolled_back(self) -> bool:
        import json

        with open(self.events_path) as f:
            lines = [line for line in f if line.strip().endswith("}")]
        return any(json.loads(line).get("action") == "rollback" for line in lines)

    def __call__(self, *, worker, step) -> None:
        import time

        end = time.monotonic() + 60
        while not self.rolled_back() and time.monotonic() < end:
            time.sleep(0.01)


def test_a_rollback_waits_for_the_save_in_flight_and_restores_it(tmp_path, reference):
    """A non-finite step right after a checkpoint boundary, while that save is still being
    written: the rollback lets the save commit and restores it (1 step lost), instead of
    dropping it for an older checkpoint (or, with none, giving up)."""
    import dataclasses

    from planaria.checkpoint.config import CheckpointConfig
    from planaria.data.plan import DataPlan

    spec = mlp.make_spec(n=N)
    plan = DataPlan(N, G, seed=spec.seed)
    step = next(s for s in range(2, STEPS) if 11 in set(plan.batch(s).tolist()))
    marker = tmp_path / "nan-once"
    marker.touch()
    events_path = str(tmp_path / "run" / "events.jsonl")
    spec = dataclasses.replace(spec, loss=_NanOnceOnSample(11, str(marker)))
    job = Job(spec, planaria.RunConfig(steps=STEPS, replicas=2, run_dir=tmp_path / "run",
                                       ledger=True),
              policy=RecoveryPolicy(on_nonfinite="rollback"),
              checkpoint=CheckpointConfig(every=step - 1))
    with job:
        for h in job.members:
            arm(job, h.name, "worker.shard_write", WritesAfterTheRollback(events_path))
        state = run_to(job, STEPS)
        final_step = job.steps_done
    assert not marker.exists()  # the NaN fired
    assert final_step == STEPS
    assert_same_state(reference, state)
    assert_exactly_once(tmp_path / "run", num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path / "run")
    (restore,) = of(evs, "restore")
    assert (restore["step"], restore["lost_steps"]) == (step - 1, 1)
    assert not [e for e in of(evs, "checkpoint_failed") if e["step"] == step - 1]
    (rollback,) = [a for a in of(evs, "action") if a["action"] == "rollback"]
    saved = next(e for e in of(evs, "checkpoint_saved") if e["step"] == step - 1)
    assert rollback["t"] < saved["t"] < restore["t"]  # in flight at the rollback, waited for
