"""A shard staged as one image of its file and written with O_DIRECT: the same bytes as a
tensor-by-tensor write, a snapshot that later training cannot touch, a fallback where the
file system refuses direct I/O, and a read-back that goes to the disk."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import planaria.checkpoint.direct_io as direct_io
import planaria.checkpoint.writer as writer
from planaria.checkpoint import (
    CorruptCheckpoint,
    commit_checkpoint,
    load_checkpoint,
    new_save_id,
    plan_shards,
    take_share,
    write_shard,
)
from planaria.checkpoint.async_writer import AsyncShardWriter
from planaria.checkpoint.layout import shard_file_name
from planaria.checkpoint.staging import ShardImage
from planaria.checkpoint.storage import Storage
from planaria.checkpoint.writer import shard_dir, write_image
from tests.checkpoint.test_checkpoint_roundtrip import assert_same, make_state


def shard_path(root: Path, step: int, index: int, num: int, save_id: str) -> Path:
    return Path(shard_dir(Storage(str(root)), step, save_id)) / shard_file_name(index, num)


def assert_round_trip(root: Path, state: dict[str, torch.Tensor], step: int) -> None:
    """One writer stages ``state``, writes and verifies it, commits; it loads back equal."""
    (plan,) = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, 1)
    image = ShardImage()
    image.fill(state, plan, step)
    record = write_image(str(root), step, 0, 1, image, verify=True)
    path = commit_checkpoint(str(root), step, [record], {}, world_size=1)
    assert_same(load_checkpoint(path)[0], state)


@pytest.fixture
def direct_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What each write_direct call answered (True: written with O_DIRECT)."""
    calls: list[bool] = []
    real = writer.write_direct

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(writer, "write_direct", spy)
    return calls


@pytest.mark.parametrize("direct", [True, False])
def test_staged_image_is_the_file_write_shard_writes(tmp_path: Path, direct: bool,
                                                     direct_calls: list[bool]) -> None:
    state = make_state()
    plans = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, 3, split_bytes=40_000)
    image = ShardImage()
    for p in plans:
        by_views = write_shard(str(tmp_path / "a"), 7, p.index, 3, take_share(state, p),
                               save_id="s", verify=True)
        image.fill(state, p, 7)
        staged = write_image(str(tmp_path / "b"), 7, p.index, 3, image, save_id="s",
                             verify=True, direct=direct)
        assert staged == by_views
        a = shard_path(tmp_path / "a", 7, p.index, 3, "s").read_bytes()
        b = shard_path(tmp_path / "b", 7, p.index, 3, "s").read_bytes()
        assert a == b
    assert direct_calls == ([True] * 3 if direct else [])


def test_the_image_is_a_snapshot_and_is_reused(tmp_path: Path) -> None:
    state = make_state()
    plans = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, 2)
    root, sid = str(tmp_path), new_save_id()
    images = [ShardImage() for _ in plans]
    for im, p in zip(images, plans, strict=True):
        im.fill(state, p, 1)
    before = {k: v.clone() for k, v in state.items()}
    for v in state.values():
        if v.is_floating_point():
            v.add_(1.0)  # training goes on after the snapshot
    records = [write_image(root, 1, p.index, 2, im, save_id=sid, verify=True)
               for im, p in zip(images, plans, strict=True)]
    path = commit_checkpoint(root, 1, records, {"step": 1}, world_size=2)
    assert_same(load_checkpoint(path)[0], before)
    addr = images[0]._raw.data_ptr()  # type: ignore[union-attr]
    images[0].fill(state, plans[0], 2)
    assert images[0]._raw.data_ptr() == addr  # type: ignore[union-attr]
    assert images[0].view().nbytes % direct_io.ALIGN == 0


def test_file_systems_without_direct_io_get_a_buffered_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_calls: list[bool]
) -> None:
    monkeypatch.setattr(direct_io, "_O_DIRECT", 0)  # as on tmpfs or a FUSE mount
    state = make_state()
    assert_round_trip(tmp_path, state, 3)
    assert direct_calls == [False]


def test_read_back_reads_the_disk_and_catches_a_changed_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = writer.write_direct

    def write_then_damage(path: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        assert real(path, *args, **kwargs)
        with open(path, "r+b") as f:  # the storage hands back other bytes than written
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 0xFF]))
        return True

    monkeypatch.setattr(writer, "write_direct", write_then_damage)
    state = {"w": torch.arange(5000, dtype=torch.float32)}
    (plan,) = plan_shards({"w": ((5000,), torch.float32)}, 1)
    image = ShardImage()
    image.fill(state, plan, 1)
    with pytest.raises(CorruptCheckpoint, match=r"read back differs.*tensor 'w'"):
        write_image(str(tmp_path), 1, 0, 1, image, verify=True)


def test_a_shard_larger_than_the_scratch_buffer_is_read_back_in_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ShardImage, "SCRATCH_BYTES", 2 * direct_io.ALIGN)
    assert_round_trip(tmp_path, {"a": torch.randn(3001), "b": torch.randn(17, 33).double()}, 2)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_the_background_write_runs_on_idle_cpu_time_only(tmp_path: Path) -> None:
    w = AsyncShardWriter(str(tmp_path))
    policies = [w._pool.submit(os.sched_getscheduler, 0).result(),
                w._pool.submit(_policy_of_a_child).result()]  # its helper threads inherit it
    assert policies == [os.SCHED_IDLE, os.SCHED_IDLE]
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the caller (training) is untouched
    w.close()


def _policy_of_a_child() -> int:
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(os.sched_getscheduler(0)))
    t.start()
    t.join()
    return out[0]
