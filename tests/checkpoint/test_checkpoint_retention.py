"""Retention keeps the last K and every N-th, and never the newest viable checkpoint."""

from __future__ import annotations

import os

import pytest
import torch

from planaria.checkpoint import (
    apply_retention,
    commit_checkpoint,
    latest_viable,
    list_checkpoints,
    plan_shards,
    take_share,
    write_shard,
)


def quick_save(root: str, step: int) -> str:
    state = {"w": torch.full((64,), float(step))}
    plans = plan_shards({"w": ((64,), torch.float32)}, 2, split_bytes=128)
    records = [write_shard(root, step, p.index, 2, take_share(state, p)) for p in plans]
    return commit_checkpoint(root, step, records, {"step": step}, world_size=2)


def steps(root: str) -> list[int]:
    return [c.step for c in list_checkpoints(root)]


@pytest.mark.parametrize("root_kind", ["local", "memory"])
def test_keep_last_and_every(tmp_path, root_kind: str) -> None:
    root = str(tmp_path) if root_kind == "local" else f"memory://ret-{os.getpid()}-{id(tmp_path)}"
    for s in range(100, 1100, 100):
        quick_save(root, s)
    deleted = apply_retention(root, keep_last=3, keep_every=500)
    assert steps(root) == [500, 800, 900, 1000]
    assert deleted == [100, 200, 300, 400, 600, 700]
    assert apply_retention(root, keep_last=3, keep_every=500) == []
    if root_kind == "local":
        assert sorted(os.listdir(root)) == [f"step_{s:09d}" for s in (500, 800, 900, 1000)]


def test_newest_viable_is_never_deleted(tmp_path) -> None:
    root = str(tmp_path)
    quick_save(root, 1)
    quick_save(root, 2)
    bad = quick_save(root, 3)
    shard = os.path.join(bad, "shard-00001-of-00002.safetensors")
    with open(shard, "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\xff")
    apply_retention(root, keep_last=1)
    assert steps(root) == [2, 3]
    assert latest_viable(root, lineage=[None])[0] == os.path.join(root, "step_000000002")


def test_uncommitted_are_left_alone(tmp_path) -> None:
    root = str(tmp_path)
    quick_save(root, 1)
    os.remove(os.path.join(quick_save(root, 2), "COMMITTED"))
    quick_save(root, 3)
    apply_retention(root, keep_last=1)
    assert steps(root) == [2, 3]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        apply_retention("memory://x", keep_last=0)
    with pytest.raises(ValueError):
        apply_retention("memory://x", keep_last=1, keep_every=0)
