"""Restoring into tensors on a device through a bounded host window (device_load).

The window logic is the same whatever the targets' device: here the targets are host
tensors, so the batches, the views into the reused window and the verified reads are
checked on any machine (``tests/worker/test_gpu.py`` restores GPU state through it)."""

from __future__ import annotations

import pytest
import torch
from test_checkpoint_roundtrip import assert_same, make_state, save

from planaria.checkpoint import CorruptCheckpoint, load_checkpoint, read_manifest
from planaria.checkpoint.device_load import load_to_device, plan_batches


def test_batches_stay_within_the_budget_unless_one_tensor_is_bigger():
    sizes = {"a": 100, "b": 100, "c": 1000, "d": 10, "e": 0}
    batches = plan_batches(sizes, budget=256)
    assert sorted(n for b in batches for n in b) == sorted(sizes)
    assert ["c"] in batches  # bigger than the budget: alone
    for b in batches:
        if b != ["c"]:
            assert sum((sizes[n] + 63) // 64 * 64 for n in b) <= 256


@pytest.mark.parametrize("budget", [1 << 10, 64 << 10, 1 << 30])
def test_load_to_device_equals_a_whole_load(tmp_path, budget):
    state = make_state()
    path = save(str(tmp_path), 5, state, 3)
    expected, meta = load_checkpoint(path)
    targets = {n: torch.full_like(t, 0) if t.dtype != torch.bool else torch.zeros_like(t)
               for n, t in expected.items()}
    moved: list[int] = []
    got, got_meta = load_to_device(path, sorted(expected), targets, budget=budget,
                                   on_progress=moved.append)
    assert_same(got, expected)
    assert all(got[n] is targets[n] for n in got)  # filled in place
    assert got_meta == meta and sum(moved) > 0


def test_a_flipped_byte_is_caught(tmp_path):
    state = make_state()
    path = save(str(tmp_path), 5, state, 3)
    manifest = read_manifest(path)
    entry = manifest.tensors["model/big.weight"].slices[0]
    shard = tmp_path / "step_000000005" / manifest.data_dir / entry.file \
        if manifest.data_dir else tmp_path / "step_000000005" / entry.file
    data = bytearray(shard.read_bytes())
    data[entry.offsets[0] + 5] ^= 0x10
    shard.write_bytes(bytes(data))
    targets = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in state.items()}
    with pytest.raises(CorruptCheckpoint, match=r"big\.weight"):
        load_to_device(path, sorted(state), targets, budget=4096)
