"""SIGKILL a process at random points of save + commit: only committed, verified
checkpoints are ever returned, and committed older ones are never touched."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import signal
import time
from typing import Any

import pytest
import torch
from test_checkpoint_roundtrip import assert_same, make_state, save

from planaria.checkpoint import (
    AsyncShardWriter,
    clean_leftovers,
    commit_checkpoint,
    latest_viable,
    list_checkpoints,
    load_checkpoint,
    new_save_id,
    plan_shards,
)

ROUNDS = 24


def _saver(root: str, first_step: int, started: Any) -> None:
    """The victim: a job start (clean-up) and then saves, as fast as it can, until killed."""
    torch.set_num_threads(1)
    started.set()  # the kill's random point counts from here, not from the process's start
    clean_leftovers(root)
    writers = [AsyncShardWriter(root) for _ in range(3)]
    for step in range(first_step, first_step + 10_000):
        state = make_state(step)
        plans = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, 3,
                            split_bytes=20_000)
        sid = new_save_id()
        for w, p in zip(writers, plans, strict=True):
            w.start(step, state, p, save_id=sid)
        records = [w.result(timeout_s=60) for w in writers]
        commit_checkpoint(root, step, records, {"step": step}, world_size=3)


def _digest(path: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.mark.slow
def test_sigkill_at_random_points(tmp_path) -> None:
    root = str(tmp_path)
    kept = {s: _digest(save(root, s, make_state(s), 2)) for s in (1, 2)}
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "planaria.checkpoint", "test_checkpoint_roundtrip"])
    rng = random.Random(1234)
    newest = 2
    for r in range(ROUNDS):
        started = ctx.Event()
        proc = ctx.Process(target=_saver, args=(root, 100 * (r + 1), started), daemon=True)
        proc.start()
        assert started.wait(120), "the saver did not start"
        time.sleep(rng.uniform(0.0, 0.6))
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL, "the saver must die mid-way, not finish"

        path, _ = latest_viable(root, lineage=[None])
        assert path is not None
        tensors, meta = load_checkpoint(path)
        step = meta["step"]
        assert_same(tensors, make_state(step))
        assert step >= newest  # a committed checkpoint never disappears
        newest = step
        for s, digest in kept.items():
            assert _digest(os.path.join(root, f"step_{s:09d}")) == digest
        committed = [c for c in list_checkpoints(root) if c.committed]
        assert committed[-1].step == step
    assert newest > 2, "no round got far enough to commit: the kill points are all too early"
    clean_leftovers(root)
    assert all(c.committed for c in list_checkpoints(root))
    assert not [n for n in os.listdir(root) if ".tmp-" in n or ".trash-" in n]
