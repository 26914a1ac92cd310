"""Checkpoints a user can trust, in running jobs: a root shared by two runs, a checkpoint that
does not fit, storage errors on read and on write, a save slower than the interval, and a
root whose checkpoints are all broken.

Fault tests assert that training reaches the parameters of a fault-free run and that every
sample was used exactly once.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import ray
from torch import nn

from planaria import Job, RecoveryPolicy, RunConfig, fit
from planaria.checkpoint import list_checkpoints, read_manifest
from planaria.checkpoint.config import CheckpointConfig
from planaria.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatch,
    NoViableCheckpoint,
    OtherRunCheckpoints,
)
from planaria.examples import mlp
from tests.assertions import assert_exactly_once, assert_same_state, events, of

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, G, STEPS = 512, 64, 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ray_cluster):
    return fit(mlp.make_spec(n=N), steps=STEPS, replicas=2,
               run_dir=tmp_path_factory.mktemp("ref")).state_dict


@pytest.fixture(scope="module")
def old_run(tmp_path_factory, ray_cluster) -> Path:
    """A finished run of 8 steps at 2 replicas, checkpointed at steps 4 and 8."""
    run_dir = tmp_path_factory.mktemp("old")
    fit(mlp.make_spec(n=N), steps=8, replicas=2, run_dir=run_dir,
        checkpoint=CheckpointConfig(every=4))
    return run_dir / "checkpoints"


@pytest.mark.extended  # run identity: the other tests of this file
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_root_shared_by_two_runs(old_run: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    import shutil

    shutil.copytree(old_run, root)
    with pytest.raises(OtherRunCheckpoints, match=r"steps 4, 8.*overwrite.*branch"):
        fit(mlp.make_spec(n=N), steps=6, replicas=2, run_dir=tmp_path / "refused",
            checkpoint=CheckpointConfig(every=3, resume=False, root=str(root)))
    cfg = RunConfig(steps=6, replicas=2, run_dir=tmp_path / "branch")
    ckpt = CheckpointConfig(every=3, keep_last=1, resume=False, on_other_run="branch",
                            root=str(root))
    with Job(mlp.make_spec(n=N), cfg, checkpoint=ckpt) as job:
        while job.steps_done < 6:
            job.train_step()
        job.checkpointer.save_final()
        mine = {k: v.clone() for k, v in job.model_state_dict().items()}
        assert job.checkpointer.restore() == 6  # its own step 6, never the old run's step 8
        assert_same_state(mine, job.model_state_dict())
    # Retention ranked only this run's checkpoints (and kept two): the old run's are intact.
    assert [c.step for c in list_checkpoints(str(root))] == [3, 4, 6, 8]
    (lineage,) = of(events(tmp_path / "branch"), "checkpoint_lineage")
    assert lineage["mode"] == "branch" and lineage["other_runs"]
    # A later run that resumes continues the branch, the root's newest lineage.
    with Job(mlp.make_spec(n=N), RunConfig(steps=6, replicas=2, run_dir=tmp_path / "next"),
             checkpoint=CheckpointConfig(root=str(root))) as job:
        assert job.steps_done == 6


def mismatched_model() -> nn.Module:
    """The MLP with a narrower first layer and one layer more."""
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 128), nn.Tanh(),
                         nn.Linear(128, 1), nn.Linear(1, 1))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_restore_with_missing_and_misshaped_tensors(old_run: Path, tmp_path: Path) -> None:
    spec = dataclasses.replace(mlp.make_spec(n=N), model=mismatched_model)
    with pytest.raises(CheckpointMismatch) as info:
        fit(spec, steps=10, replicas=2, run_dir=tmp_path,
            checkpoint=CheckpointConfig(root=str(old_run)))
    text = str(info.value)
    assert "not in the checkpoint: model/5.bias, model/5.weight" in text
    assert "model/0.weight (checkpoint [128, 32], job [64, 32])" in text
    # The data plan is compared too.
    with pytest.raises(CheckpointMismatch, match="num_samples: checkpoint 512, job 640"):
        fit(mlp.make_spec(n=640), steps=10, replicas=2, run_dir=tmp_path / "plan",
            checkpoint=CheckpointConfig(root=str(old_run)))


def flaky_storage_model() -> nn.Module:
    """The MLP, in a worker whose first checkpoint write and first checkpoint read each
    fail with an I/O error (the retries must absorb both)."""
    import planaria.checkpoint.async_writer as aw
    import planaria.worker.ckpt_restore as wc

    if not getattr(aw, "_flaky", False):
        write, load = aw.write_image, wc.load_checkpoint
        failed: set[str] = set()

        def once(kind: str, fn):  # type: ignore[no-untyped-def]
            def call(*args, **kwargs):  # type: ignore[no-untyped-def]
                if kind not in failed:
                    failed.add(kind)
                    raise OSError(5, f"injected {kind} error")
                return fn(*args, **kwargs)
            return call

        aw.write_image = once("write", write)
        wc.load_checkpoint = once("read", load)
        aw._flaky = True
    return mlp.make_model()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_storage_errors_on_write_and_read_are_retried(tmp_path: Path, reference) -> None:
    spec = dataclasses.replace(mlp.make_spec(n=N), model=flaky_storage_model)
    result = fit(spec, steps=STEPS, replicas=2, run_dir=tmp_path, ledger=True,
                 chaos="kill:w0@step7,kill:w1@step7",
                 checkpoint=CheckpointConfig(every=3))
    assert result.final_step == STEPS
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    (restore,) = of(evs, "restore")
    before = [e["step"] for e in evs[:evs.index(restore)] if e["event"] == "checkpoint_saved"]
    assert before and before[0] == 3  # the first save's write failed once and was retried
    assert restore["step"] == before[-1] and not restore["skipped"]  # its first read too
    # A save in flight when every replica died is abandoned; none failed on the storage.
    assert all("injected" not in e["error"] for e in of(evs, "checkpoint_failed"))
    assert "user_code_error" not in [e["kind"] for e in of(evs, "fault")]


def slow_reads_model() -> nn.Module:
    """The MLP, in a worker whose checkpoint reads move 8 KB every 0.1 s (a slow but live
    file system: a restore of its ~250 KB takes seconds)."""
    import time

    import planaria.checkpoint.restore as rs

    if not getattr(rs, "_slowed", False):
        original = rs.read_verified

        def slow(f, targets, segments=(), *, on_progress=None, **kwargs):  # type: ignore[no-untyped-def]
            def moved(n: int) -> None:
                time.sleep(0.1)  # simulated slow storage, not a wait on another thread
                if on_progress is not None:
                    on_progress(n)
            kwargs["chunk_bytes"] = 8192
            return original(f, targets, segments, on_progress=moved, **kwargs)

        rs.read_verified = slow
        rs._slowed = True
    return mlp.make_model()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_restore_slower_than_its_deadline_that_moves_bytes_is_not_hung(
    tmp_path: Path, reference
) -> None:
    spec = dataclasses.replace(mlp.make_spec(n=N), model=slow_reads_model)
    cfg = CheckpointConfig(every=3, timeout_s=1.0, min_bytes_per_s=1e12)  # deadline ~1 s
    result = fit(spec, steps=STEPS, replicas=2, run_dir=tmp_path, ledger=True,
                 chaos="kill:w0@step7,kill:w1@step7", checkpoint=cfg)
    assert result.final_step == STEPS
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    (restore,) = of(evs, "restore")
    assert restore["restore_s"] > 2.0  # it did take longer than its deadline
    assert of(evs, "hang_stack") == []  # and no reader was killed as hung
    assert {e["kind"] for e in of(evs, "fault")} == {"all_replicas_lost"}


def slow_writes_model() -> nn.Module:
    """The MLP, in a worker whose checkpoint writes take ~0.4 s (several steps)."""
    import time

    import planaria.checkpoint.async_writer as aw

    if not getattr(aw, "_slowed", False):
        original = aw.write_image

        def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(0.4)  # simulated slow storage, not a wait on another thread
            return original(*args, **kwargs)

        aw.write_image = slow
        aw._slowed = True
    return mlp.make_model()


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_save_slower_than_the_interval_counts_as_stall(tmp_path: Path, reference) -> None:
    spec = dataclasses.replace(mlp.make_spec(n=N), model=slow_writes_model)
    result = fit(spec, steps=STEPS, replicas=2, run_dir=tmp_path, ledger=True,
                 checkpoint=CheckpointConfig(every=1))
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    saved = of(events(tmp_path), "checkpoint_saved")
    assert [e["step"] for e in saved] == list(range(1, STEPS + 1))
    waited = [e for e in saved if e["wait_s"] > 0]
    assert len(waited) >= STEPS - 2  # every save but the first waited for the previous one
    assert all(e["stall_s"] >= e["wait_s"] for e in saved)
    assert sum(e["wait_s"] for e in saved) >= 0.3 * (STEPS - 2)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_no_viable_checkpoint_is_an_error_not_step_0(old_run: Path, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "root"
    shutil.copytree(old_run, root)
    for info in list_checkpoints(str(root)):
        manifest = read_manifest(info.path)
        entry = manifest.files[0]
        with open(os.path.join(info.path, entry.name), "r+b") as f:
            f.seek(entry.data_start + 3)
            byte = f.read(1)
            f.seek(entry.data_start + 3)
            f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(NoViableCheckpoint, match=r"step 8.*checksum mismatch"):
        fit(mlp.make_spec(n=N), steps=10, replicas=2, run_dir=tmp_path / "run",
            checkpoint=CheckpointConfig(root=str(root)))
    assert RecoveryPolicy().allow_restart_from_scratch is False


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_root_the_workers_cannot_read_is_refused_at_start(tmp_path: Path) -> None:
    # registers faulty:// here, in the controller only
    from planaria.faults.campaign.storage_faults import counted_failures

    cfg = CheckpointConfig(every=2, root=f"faulty://{tmp_path}/root",
                           storage_options=counted_failures("probe", (), ()))
    with pytest.raises(CheckpointError, match=r"not readable from every worker \(w0: .*w1: "):
        fit(mlp.make_spec(n=N), steps=4, replicas=2, run_dir=tmp_path / "run", checkpoint=cfg)
    assert not list((tmp_path / "root").glob("PROBE-*"))


def broken_storage_model() -> nn.Module:
    """The MLP, in a worker whose every checkpoint write fails with an I/O error."""
    import planaria.checkpoint.async_writer as aw

    def fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise PermissionError(13, "injected: write denied")

    aw.write_shard = aw.write_image = fail
    return mlp.make_model()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_failed_final_save_fails_fit(tmp_path: Path) -> None:
    spec = dataclasses.replace(mlp.make_spec(n=N), model=broken_storage_model)
    with pytest.raises(CheckpointError, match=r"final checkpoint \(step 3\) was not committed"
                       ) as raised:
        fit(spec, steps=3, replicas=2, run_dir=tmp_path,
            checkpoint=CheckpointConfig(every=100, storage_attempts=2))
    raised.value.job.close()  # left open, its state in the workers: the caller closes it
    (failed,) = of(events(tmp_path), "checkpoint_failed")
    assert failed["step"] == 3 and "write denied" in failed["error"]


def corrupt_all(root: str) -> None:
    for info in list_checkpoints(root):
        entry = read_manifest(info.path).files[0]
        with open(os.path.join(info.path, entry.name), "r+b") as f:
            f.seek(entry.data_start + 3)
            byte = f.read(1)
            f.seek(entry.data_start + 3)
            f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("allow", [False, True])
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_every_replica_lost_and_no_checkpoint_restores(tmp_path: Path, reference,
                                                       allow: bool) -> None:
    import signal

    import planaria
    from planaria.faults.errors import ElasticRuntimeError

    policy = RecoveryPolicy(allow_restart_from_scratch=allow)
    cfg = RunConfig(steps=STEPS, replicas=2, run_dir=tmp_path)
    with Job(mlp.make_spec(n=N), cfg, policy=policy,
             checkpoint=CheckpointConfig(every=3)) as job:
        while job.steps_done < 7:
            job.train_step()
        job.checkpointer.save_now(reason="test")
        corrupt_all(job.checkpointer.root)
        for handle in job.members:
            os.kill(handle.pid, signal.SIGKILL)
        if not allow:
            with pytest.raises(ElasticRuntimeError, match=r"lose all 7 steps.*allow_restart"):
                while job.steps_done < STEPS:
                    try:
                        job.train_step()
                    except planaria.Failure as failure:
                        job.recovery.handle(failure)
            return
        while job.steps_done < STEPS:
            try:
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        state = job.model_state_dict()
    assert_same_state(reference, state)
    restores = of(events(tmp_path), "restore")
    assert restores[-1]["step"] == 0 and restores[-1]["lost_steps"] == 7


def counting_model() -> nn.Module:
    model = mlp.make_model()
    model.seen = 0  # type: ignore[assignment]  # user state beyond the tensors (an EMA's count)
    return model


def counting_loss(model, batch):  # type: ignore[no-untyped-def]
    model.seen += 1
    return mlp.mse(model, batch)


def counting_spec():  # type: ignore[no-untyped-def]
    return dataclasses.replace(
        mlp.make_spec(n=N), model=counting_model, loss=counting_loss,
        extra_state=(lambda model, opt: {"seen": model.seen},
                     lambda model, opt, state: setattr(model, "seen", state["seen"])),
    )


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_extra_state_survives_a_restore(tmp_path: Path, reference) -> None:
    # min_replicas=2: the width (and so each replica's count of micro-batches) never changes.
    result = fit(counting_spec(), steps=STEPS, replicas=2, run_dir=tmp_path, ledger=True,
                 chaos="kill:w0@step7,kill:w1@step7", checkpoint=CheckpointConfig(every=3),
                 policy=RecoveryPolicy(min_replicas=2))
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    final = read_manifest(str(tmp_path / "checkpoints" / f"step_{STEPS:09d}"))
    # 2 micro-batches per replica per step: the count of a fault-free run.
    assert final.meta["extra_state"] == {"seen": 2 * STEPS}
    assert of(events(tmp_path), "restore")
