"""Checkpoints in running jobs: restore at any width, corruption fallback, in-process restore
when every replica is lost, a writer killed mid-save, whole-job SIGKILLs during saves, S3.

Every fault test asserts that training reaches the parameters of a fault-free run and
(with the ledger) that every sample was used exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

import planaria
from planaria import Job, RunConfig, fit
from planaria.checkpoint import commit_checkpoint as commit_ckpt
from planaria.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    plan_shards,
    read_manifest,
    take_share,
    verify_checkpoint,
    write_shard,
)
from planaria.checkpoint.config import CheckpointConfig
from planaria.checkpoint.manifest import parse_marker
from planaria.checkpoint.writer import RECORD_SUFFIX, SAVE_FILE
from planaria.examples import mlp
from planaria.faults.errors import CheckpointError, ConfigError
from tests.assertions import assert_exactly_once, assert_same_state, events, of, run_to

# The workers unpickle this module's helpers by value: they cannot import the tests package.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, G, STEPS = 512, 64, 20


def job_state(job: Job) -> dict[str, torch.Tensor]:
    tensors, _ = job.state()
    return tensors


# ---- no Ray ----------------------------------------------------------------------------------


def test_config_validation_and_cli() -> None:
    cfg = CheckpointConfig.from_cli("10m", resume=False, root=None)
    assert cfg.every == "10m" and cfg.resume is False and cfg.root is None
    assert CheckpointConfig.from_cli(None, True, "s3://b/x").root == "s3://b/x"
    for bad in ({"every": "sometimes"}, {"every": 0}, {"keep_last": 0}, {"if_busy": "later"},
                {"restore_strategy": "guess"}):
        with pytest.raises(ConfigError):
            CheckpointConfig(**bad)  # type: ignore[arg-type]


def test_crc32_manifests_still_read(tmp_path: Path) -> None:
    state = {"a": torch.randn(300, 7), "b": torch.arange(10)}
    plan = plan_shards({k: (v.shape, v.dtype) for k, v in state.items()}, 1)[0]
    rec = write_shard(str(tmp_path), 1, 0, 1, take_share(state, plan), algorithm="crc32")
    path = commit_ckpt(str(tmp_path), 1, [rec], {}, world_size=1)
    assert read_manifest(path).checksum == "crc32"
    tensors, _ = load_checkpoint(path)
    assert torch.equal(tensors["a"], state["a"])
    shard = next(Path(path).glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10
    shard.write_bytes(bytes(data))
    assert not verify_checkpoint(path).ok


# ---- jobs ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ray_cluster):
    """Fault-free final parameters after STEPS steps."""
    return fit(mlp.make_spec(n=N), steps=STEPS, replicas=3,
               run_dir=tmp_path_factory.mktemp("ref")).state_dict


@pytest.fixture(scope="module")
def saved3(tmp_path_factory, ray_cluster) -> Path:
    """A run of 8 steps at 3 replicas, checkpointed at steps 4 and 8."""
    run_dir = tmp_path_factory.mktemp("saved3")
    fit(mlp.make_spec(n=N), steps=8, replicas=3, run_dir=run_dir,
        checkpoint=CheckpointConfig(every=4))
    evs = events(run_dir)
    assert [e["step"] for e in of(evs, "checkpoint_saved")] == [4, 8]
    assert all(e["writers"] == 3 for e in of(evs, "checkpoint_saved"))
    return run_dir / "checkpoints"


@pytest.mark.parametrize(("width", "strategy"), [
    (1, "read_all"), (3, "share"),
    pytest.param(2, "share", marks=pytest.mark.extended),
    pytest.param(2, "read_all", marks=pytest.mark.extended),
])
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_restore_at_any_width(saved3: Path, tmp_path: Path, width: int, strategy: str) -> None:
    expected, meta = load_checkpoint(str(saved3 / "step_000000008"))
    assert meta["steps_done"] == 8 and meta["world_size"] == 3
    cfg = CheckpointConfig(root=str(saved3), restore_strategy=strategy)  # type: ignore[arg-type]
    with Job(mlp.make_spec(n=N), RunConfig(steps=8, replicas=width, run_dir=tmp_path),
             checkpoint=cfg) as job:
        assert job.steps_done == 8
        got = job_state(job)
        assert len(set(job.checksums().values())) == 1  # every replica holds the same
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    (restore,) = of(events(tmp_path), "restore")
    assert restore["step"] == 8 and restore["width"] == width and restore["strategy"] == strategy


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_flipped_bit_falls_back_to_previous(saved3: Path, tmp_path: Path, caplog) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(saved3, root)
    shard = root / "step_000000008" / "shard-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) - 100] ^= 0x04  # one bit of a tensor's data
    shard.write_bytes(bytes(data))
    caplog.set_level("WARNING", logger="planaria.checkpoint")
    with Job(mlp.make_spec(n=N), RunConfig(steps=8, replicas=2, run_dir=tmp_path),
             checkpoint=CheckpointConfig()) as job:
        assert job.steps_done == 4
    (restore,) = of(events(tmp_path), "restore")
    assert restore["step"] == 4 and restore["path"].endswith("step_000000004")
    assert "shard-00002-of-00003.safetensors" in restore["skipped"][0]
    assert "checksum mismatch" in restore["skipped"][0]
    assert any("shard-00002-of-00003.safetensors" in r.getMessage() for r in caplog.records)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_all_replicas_lost_restores_in_process(tmp_path: Path, reference) -> None:
    spec = mlp.make_spec(n=N)
    cfg = RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True)
    chaos = planaria.ChaosPlan.parse("kill:w0@step10,kill:w1@step10,kill:w2@step10",
                                     seed=spec.seed)
    with Job(spec, cfg, chaos=chaos, checkpoint=CheckpointConfig(every=4)) as job:
        run_to(job, 10)
        job.checkpointer.finish_inflight()  # step 8's background save commits before the kill
        assert job.checkpointer.last_committed == 8
        run_to(job, STEPS)
        job.checkpointer.save_final()
        state = job.model_state_dict()
    assert job.steps_done == STEPS
    assert_same_state(reference, state)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    (restore,) = of(evs, "restore")
    committed = [c["step"] for c in of(evs, "checkpoint_saved") if c["t"] <= restore["t"]]
    assert committed == [4, 8] and restore["step"] == 8  # the newest committed checkpoint
    assert restore["lost_steps"] == 2 and restore["restore_s"] > 0
    assert "restore" in [e["action"] for e in of(evs, "action")]
    assert of(evs, "checkpoint_saved")[-1]["step"] == STEPS


class DiesWritingStep:
    """The MLP, in workers where the first writer of step ``step`` to claim ``marker`` (an
    atomic rename) is killed part-way through its shard: the file half written, the process
    SIGKILLed before its record is (a writer killed mid-save, at a point the test names)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker

    def __call__(self) -> torch.nn.Module:
        import planaria.checkpoint.async_writer as aw

        if not getattr(aw, "_dies_writing", False):
            original = aw.write_image
            step, marker = self.step, self.marker

            def write_or_die(root, at, index, *args, **kwargs):
                record = original(root, at, index, *args, **kwargs)
                if at != step:
                    return record
                try:
                    os.rename(marker, marker + ".claimed")
                except FileNotFoundError:
                    return record  # another writer died: this one writes its shard
                for shard in Path(root).glob(f"step_{at:09d}.tmp-*/shard-{index + 1:05d}-of-*"):
                    with open(shard, "r+b") as f:
                        f.truncate(shard.stat().st_size // 2)
                os.kill(os.getpid(), signal.SIGKILL)
                return record

            aw.write_image = write_or_die
            aw._dies_writing = True
        return mlp.make_model()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_writer_killed_mid_save_leaves_it_uncommitted(tmp_path: Path, reference) -> None:
    marker = tmp_path / "die-writing"
    marker.touch()
    spec = dataclasses.replace(mlp.make_spec(n=N), model=DiesWritingStep(6, str(marker)))
    run_dir = tmp_path / "run"
    cfg = RunConfig(steps=STEPS, replicas=3, run_dir=run_dir, ledger=True)
    with Job(spec, cfg, checkpoint=CheckpointConfig(every=3)) as job:
        run_to(job, STEPS)
        job.checkpointer.save_final()
        state = job.model_state_dict()
    assert not marker.exists()  # a writer of step 6 died mid-save
    assert_same_state(reference, state)
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run_dir)
    (failed,) = of(evs, "checkpoint_failed")
    (fault,) = of(evs, "fault")
    assert failed["step"] == 6 and f"writer {fault['worker']} failed" in failed["error"]
    assert fault["kind"] == "worker_lost"
    saved = [e["step"] for e in of(evs, "checkpoint_saved")]
    assert 6 not in saved and saved[-1] == STEPS and saved[0] == 3
    root = run_dir / "checkpoints"
    assert not (root / "step_000000006").exists()
    for info in list_checkpoints(str(root)):
        assert info.committed and verify_checkpoint(info.path).ok
    end = time.monotonic() + 60  # the surviving writers' leftovers go once they finish
    while (left := [p.name for p in root.iterdir() if ".tmp-" in p.name]) and \
            time.monotonic() < end:
        time.sleep(0.1)
    assert not left, left


# ---- whole-job crashes -----------------------------------------------------------------------

CRASH_STEPS = 70
CHILD = r"""
import os, random, signal, sys, threading, time
from pathlib import Path
from planaria.checkpoint.config import CheckpointConfig
from planaria import fit
from planaria.faults import points
from planaria.examples import mlp

address, run_dir, steps, replicas, mode, seed = sys.argv[1:7]
rng = random.Random(int(seed))
kill_at = rng.choice([1, 2])  # the save (counted from this run's start) to die in

def die():
    os.killpg(os.getpgid(0), signal.SIGKILL)

saves = [0]
def started(*, step, reason):
    saves[0] += 1
    if saves[0] == kill_at and mode == "timer":
        threading.Timer(rng.uniform(0.0, 0.08), die).start()
points.arm("checkpoint.save_started", started)

def die_in_the_chosen_save(*, step):
    if saves[0] == kill_at:
        die()

point = {"commit": "checkpoint.before_commit", "manifest": "checkpoint.manifest_written",
         "marker": "checkpoint.marker_written", "rename": "checkpoint.renamed"}.get(mode)
if point is not None:
    points.arm(point, die_in_the_chosen_save)

fit(mlp.make_spec(n=512), steps=int(steps), replicas=int(replicas), run_dir=Path(run_dir),
    address=address, ledger=True, checkpoint=CheckpointConfig(every=2, keep_last=2))
"""


def marked_not_renamed(root: Path) -> list[int]:
    """Steps whose save wrote its marker in its temporary directory and was killed before
    the rename into place: the next start promotes them (they are committed)."""
    steps = []
    for tmp in root.glob("step_*.tmp-*") if root.exists() else []:
        final = root / tmp.name.split(".")[0]
        try:
            parse_marker((tmp / "COMMITTED").read_bytes(), (tmp / "manifest.json").read_bytes())
        except (OSError, CheckpointError):
            continue
        if not final.exists():
            steps.append(int(final.name.removeprefix("step_")))
    return steps


def finished_not_committed(root: Path) -> list[int]:
    """Steps whose save's writers all finished (a record beside every shard, the save's
    description beside them) but whose job was killed before the commit: the next start
    commits them (``checkpoint_adopted``)."""
    steps = []
    for tmp in root.glob("step_*.tmp-*") if root.exists() else []:
        final = root / tmp.name.split(".")[0]
        try:
            desc = json.loads((tmp / SAVE_FILE).read_text())
        except (OSError, ValueError):
            continue
        if len(list(tmp.glob(f"*{RECORD_SUFFIX}"))) == desc["shards"] and not (
                final / "COMMITTED").exists():
            steps.append(int(desc["step"]))
    return steps


@pytest.mark.soak
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(1200)  # 21 job starts: ~4 min idle, much longer on a loaded machine
@pytest.mark.usefixtures("ray_cluster")
def test_whole_job_sigkill_during_saves(tmp_path: Path) -> None:
    kills = int(os.environ.get("PLANARIA_CRASH_KILLS", "20"))
    address = ray.get_runtime_context().gcs_address
    ref = fit(mlp.make_spec(n=N), steps=CRASH_STEPS, replicas=2, run_dir=tmp_path / "ref")
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    modes = ["commit", "manifest", "marker", "rename"]
    rng = random.Random(1234)
    killed = 0
    for i in range(kills + 1):
        last = i == kills
        mode = "none" if last else (modes[i // 5 % 4] if i % 5 == 0 else "timer")
        newest = [c.step for c in list_checkpoints(str(root)) if c.committed]
        adoptable = finished_not_committed(root)
        newest = sorted(newest + marked_not_renamed(root) + adoptable)
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, address, str(run_dir), str(CRASH_STEPS),
             str(1 + i % 2), mode, str(rng.randrange(1 << 30))],
            capture_output=True, text=True, timeout=120, start_new_session=True,
            cwd=Path(__file__).parents[2],
        )
        if last:
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:
            assert proc.returncode in (-signal.SIGKILL, 0), proc.stderr[-3000:]
            killed += proc.returncode == -signal.SIGKILL
        # Never torn: every committed checkpoint verifies, whatever the kill interrupted.
        infos = [c for c in list_checkpoints(str(root)) if c.committed]
        for info in infos:
            report = verify_checkpoint(info.path)
            assert report.ok, report.problems
        if newest:  # the run resumed from the newest committed (or finished) checkpoint
            evs = events(run_dir)
            restores = [e for e in of(evs, "restore") if e["reason"] == "resume"]
            assert restores[-1]["step"] == newest[-1]
            if adoptable:  # this start committed the saves its predecessor's writers finished
                assert set(adoptable) <= {e["step"] for e in of(evs, "checkpoint_adopted")}
    assert killed >= kills - 2, f"only {killed} of {kills} runs were killed during a save"
    final, meta = load_checkpoint(str(root / f"step_{CRASH_STEPS:09d}"))
    assert meta["steps_done"] == CRASH_STEPS
    assert meta["data_position"]["samples_consumed"] == CRASH_STEPS * G
    assert_same_state(ref.state_dict, {k.removeprefix("model/"): v for k, v in final.items()
                                       if k.startswith("model/")})
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=CRASH_STEPS)


# ---- S3 --------------------------------------------------------------------------------------


@pytest.mark.extended  # S3 saves and restores: tests/checkpoint/test_checkpoint_s3.py
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_s3_round_trip(tmp_path: Path, s3_options) -> None:
    root = "s3://planaria-ckpt/run1"
    cfg = CheckpointConfig(root=root, every=3, storage_options=s3_options)
    fit(mlp.make_spec(n=N), steps=6, replicas=3, run_dir=tmp_path / "a", checkpoint=cfg)
    path = f"{root}/step_000000006"
    assert verify_checkpoint(path, storage_options=s3_options).ok
    expected, _ = load_checkpoint(path, storage_options=s3_options)
    with Job(mlp.make_spec(n=N), RunConfig(steps=6, replicas=2, run_dir=tmp_path / "b"),
             checkpoint=cfg) as job:
        assert job.steps_done == 6
        got = job_state(job)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    (restore,) = of(events(tmp_path / "b"), "restore")
    assert restore["strategy"] == "share" and restore["path"].startswith("s3://")
