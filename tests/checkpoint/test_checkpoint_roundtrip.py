"""Saving and loading checkpoints: N writers, mixed dtypes, split tensors, subsets, CLI."""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from planaria.checkpoint import (
    AsyncShardWriter,
    IncompleteCheckpoint,
    ManifestError,
    StagingBuffers,
    cli,
    commit_checkpoint,
    latest_viable,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    new_save_id,
    plan_shards,
    read_manifest,
    take_share,
    verify_checkpoint,
    write_shard,
)
from planaria.faults.errors import StorageError


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model/big.weight": torch.randn(512, 96, generator=g),  # split across shards
        "model/layer.bias": torch.randn(96, generator=g).bfloat16(),
        "model/emb": torch.randn(33, 7, generator=g).half(),
        "optim/3/exp_avg": torch.randn(64, 3, generator=g, dtype=torch.float64),
        "optim/3/step": torch.tensor(17),  # 0-dim
        "optim/lr": torch.tensor(0.5),  # 0-dim float
        "data/ids": torch.arange(1000, dtype=torch.int64),
        "data/mask": torch.rand(13, generator=g) > 0.5,
        "model/empty": torch.empty(0, 4),
    }


def save(root: str, step: int, state: dict[str, torch.Tensor], writers: int = 3,
         split_bytes: int = 40_000, user_metadata: dict[str, Any] | None = None,
         storage_options: dict[str, Any] | None = None) -> str:
    plans = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, writers,
                        split_bytes=split_bytes)
    sid = new_save_id()
    records = [write_shard(root, step, p.index, writers, take_share(state, p), save_id=sid,
                           storage_options=storage_options)
               for p in plans]
    meta = {"step": step, "rng": [1, 2, 3], "data": {"epoch": 0, "position": step * 8}}
    return commit_checkpoint(root, step, records, meta, world_size=writers,
                             user_metadata=user_metadata, storage_options=storage_options)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("writers", [1, 2, 3, 5])
def test_round_trip_at_n_writers(tmp_path, writers: int) -> None:
    state = make_state()
    path = save(str(tmp_path), 12, state, writers, user_metadata={"who": "test"})
    assert path == str(tmp_path / "step_000000012")
    names = sorted(os.listdir(path))
    assert names[:2] == ["COMMITTED", "manifest.json"]
    assert names[2:] == [f"shard-{i + 1:05d}-of-{writers:05d}.safetensors" for i in range(writers)]
    tensors, meta = load_checkpoint(path)
    assert_same(tensors, state)
    assert meta == {"step": 12, "rng": [1, 2, 3], "data": {"epoch": 0, "position": 96}}
    manifest = read_manifest(path)
    assert manifest.world_size == writers and manifest.user_metadata == {"who": "test"}
    assert manifest.torch_version == torch.__version__
    if writers > 1:
        big = manifest.tensors["model/big.weight"]
        assert len(big.slices) > 1 and len({s.file for s in big.slices}) > 1


def test_plan_is_deterministic_and_balanced() -> None:
    specs = {f"t{i}": ((100 + 37 * i, 64), torch.float32) for i in range(20)}
    a = plan_shards(specs, 3)
    b = plan_shards(dict(reversed(list(specs.items()))), 3)
    assert a == b
    loads = [p.nbytes for p in a]
    assert max(loads) - min(loads) <= max(s.nbytes for p in a for s in p.slices)
    one_big = plan_shards({"w": ((3000, 1000), torch.float32)}, 3)
    loads = [p.nbytes for p in one_big]
    assert max(loads) / (sum(loads) / 3) < 1.3
    # every row of every tensor exactly once
    rows = sorted(s.rows for p in one_big for s in p.slices if s.rows)
    assert rows[0][0] == 0 and rows[-1][1] == 3000
    assert all(x[1] == y[0] for x, y in itertools.pairwise(rows))


def test_plan_rejects_reserved_names() -> None:
    with pytest.raises(ValueError):
        plan_shards({"w[0:3]": ((3,), torch.float32)}, 2)
    with pytest.raises(ValueError):
        plan_shards({"__metadata__": ((3,), torch.float32)}, 2)


def test_files_are_plain_safetensors(tmp_path) -> None:
    state = make_state()
    path = save(str(tmp_path), 1, state, 2)
    seen = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            seen.update(load_file(os.path.join(path, name)))
    assert "optim/3/step" in seen and any(k.startswith("model/big.weight[") for k in seen)


def test_subset_load_reads_only_named(tmp_path) -> None:
    state = make_state()
    path = save(str(tmp_path), 3, state, 3)
    names = ["model/big.weight", "optim/3/step"]
    tensors, _ = load_checkpoint(path, names=names)
    assert_same(tensors, {n: state[n] for n in names})
    with pytest.raises(KeyError):
        load_checkpoint(path, names=["nope"])


def test_staging_buffers_are_reused_and_snapshot_is_independent() -> None:
    state = make_state()
    (plan,) = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, 1)
    staging = StagingBuffers()
    first = take_share(state, plan, staging)
    ptrs = {k: v.data_ptr() for k, v in first.items()}
    state["model/big.weight"].add_(1.0)  # training goes on
    assert not torch.equal(first["model/big.weight"], state["model/big.weight"])
    second = take_share(state, plan, staging)
    assert {k: v.data_ptr() for k, v in second.items()} == ptrs
    assert torch.equal(second["model/big.weight"], state["model/big.weight"])


def test_async_writer_never_overlaps_and_reports(tmp_path) -> None:
    root = str(tmp_path)
    state = make_state()
    plans = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, 2)
    writers = [AsyncShardWriter(root) for _ in plans]
    for step in (1, 2):
        sid = new_save_id()
        for w, p in zip(writers, plans, strict=True):
            stall = w.start(step, state, p, save_id=sid)
            assert stall is not None and stall >= 0
        records = [w.result(timeout_s=30) for w in writers]
        assert [w.poll() for w in writers] == records
        commit_checkpoint(root, step, records, {"step": step}, world_size=2)
        state = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
    assert [c.step for c in list_checkpoints(root)] == [1, 2]
    _tensors, meta = load_checkpoint(latest_viable(root, lineage=[None])[0] or "")
    assert meta == {"step": 2}
    for w in writers:
        w.close()


def test_async_writer_waits_for_the_previous_write_and_reports_errors(tmp_path) -> None:
    state = {"w": torch.ones(4)}
    (plan,) = plan_shards({"w": ((4,), torch.float32)}, 1)
    w = AsyncShardWriter(str(tmp_path), busy_timeout_s=0.01)
    with pytest.raises(RuntimeError):
        w.result()
    import threading

    gate = threading.Event()
    w._pool.submit(gate.wait)  # hold the thread: the next write waits behind it
    assert w.start(1, state, plan) is not None
    assert w.busy and w.poll() is None
    with pytest.raises(TimeoutError, match="still running"):  # never two writes at once
        w.start(2, state, plan)
    with pytest.raises(TimeoutError):
        w.result(timeout_s=0.01)
    gate.set()
    assert w.result(timeout_s=10).step == 1
    bad = AsyncShardWriter(str(tmp_path / "file-not-dir"), attempts=1)
    (tmp_path / "file-not-dir").write_text("x")
    bad.start(1, state, plan)
    with pytest.raises(StorageError) as info:  # a storage error, once its retries are spent
        bad.result(timeout_s=10)
    assert isinstance(info.value.__cause__, OSError)
    w.close()
    bad.close()


def test_commit_checks_records(tmp_path) -> None:
    root = str(tmp_path)
    state = make_state()
    plans = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, 3)
    records = [write_shard(root, 4, p.index, 3, take_share(state, p)) for p in plans]
    with pytest.raises(IncompleteCheckpoint, match="missing"):
        commit_checkpoint(root, 4, records[:2], {}, world_size=3)
    with pytest.raises(ManifestError):
        commit_checkpoint(root, 5, records, {}, world_size=3)
    with pytest.raises(ManifestError, match="JSON"):
        commit_checkpoint(root, 4, records, {"x": object()}, world_size=3)
    os.truncate(os.path.join(root, "step_000000004.tmp-0", records[1].file.name), 10)
    with pytest.raises(IncompleteCheckpoint, match="bytes"):
        commit_checkpoint(root, 4, records, {}, world_size=3)
    assert list_checkpoints(root) == []
    # records cross process boundaries as JSON
    again = [type(r).from_dict(json.loads(json.dumps(r.to_dict()))) for r in records]
    assert again == records


def test_recommit_of_a_step_replaces_it(tmp_path) -> None:
    root = str(tmp_path)
    save(root, 7, make_state(0), 3)
    save(root, 7, make_state(1), 2)
    tensors, _ = load_checkpoint(str(tmp_path / "step_000000007"))
    assert_same(tensors, make_state(1))
    assert sorted(os.listdir(root)) == ["step_000000007"]


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_fsspec_urls(tmp_path, scheme: str) -> None:
    root = f"file://{tmp_path}" if scheme == "file" else f"memory://ckpt-{new_save_id()}"
    state = make_state()
    save(root, 1, state, 2)
    path = save(root, 2, state, 3)
    assert [c.step for c in list_checkpoints(root)] == [1, 2]
    restored, warnings = load_latest(root, lineage=[None])
    assert restored is not None and restored.step == 2 and warnings == []
    assert restored.path == path
    assert_same(restored.tensors, state)
    assert verify_checkpoint(path).ok


def test_cli_helpers(tmp_path) -> None:
    run_dir = tmp_path / "run"
    root = str(run_dir / cli.CHECKPOINTS_SUBDIR)
    state = make_state()
    save(root, 1, state, 2)
    path = save(root, 2, state, 2)
    rows = cli.ls(str(run_dir), verify=True)
    assert [(r["step"], r["committed"], r["verified"]) for r in rows] == [(1, True, True),
                                                                         (2, True, True)]
    assert cli.verify(path)["ok"]
    out = tmp_path / "weights.safetensors"
    summary = cli.export(path, str(out))
    weights = load_file(str(out))
    assert set(weights) == {n[len("model/"):] for n in state if n.startswith("model/")}
    assert torch.equal(weights["big.weight"], state["model/big.weight"])
    assert summary["tensors"] == len(weights)


def test_staging_budget_writes_over_budget_shares_without_a_copy(tmp_path) -> None:
    state = make_state()
    plans = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, 2)
    w = AsyncShardWriter(str(tmp_path), staging_budget_bytes=1024)
    w.start(1, state, plans[0], save_id="x")
    assert not w.busy and w.image.nbytes == 0  # written during start, nothing staged
    record = w.result(timeout_s=0)
    w2 = AsyncShardWriter(str(tmp_path))
    w2.start(1, state, plans[1], save_id="x")
    assert plans[1].nbytes <= w2.image.nbytes <= plans[1].nbytes + 16384  # + header, alignment
    path = commit_checkpoint(str(tmp_path), 1, [record, w2.result(timeout_s=60)], {},
                             world_size=2)
    assert_same(load_checkpoint(path)[0], state)
    w.close()
    w2.close()


def _chunks(t: torch.Tensor, k: int) -> list[tuple[int, torch.Tensor]]:
    """FSDP2's dim-0 sharding over k workers: (first row, shard), ceil-sized, the last ones
    shorter or empty."""
    per = -(-t.shape[0] // k)
    return [(min(i * per, t.shape[0]), t[i * per : (i + 1) * per]) for i in range(k)]


@pytest.mark.parametrize(("saved_k", "read_k"), [(2, 1), (2, 3), (3, 2), (4, 4)])
def test_row_shards_saved_at_one_k_load_at_another(tmp_path, saved_k, read_k):
    """A sharded replica's workers write rows of the whole tensors (each shard once, spread
    over the replicas); a worker of another sharding reads its own rows, through slices
    that are wholly, partly or not at all in its window."""
    from planaria.checkpoint import plan_row_shards

    g = torch.Generator().manual_seed(3)
    whole = {"model/w": torch.randn(7, 5, generator=g), "model/b": torch.randn(3, generator=g),
             "optim/0/exp_avg": torch.randn(7, 5, generator=g, dtype=torch.float64),
             "optim/0/step": torch.tensor(4.0)}  # held whole by every worker
    sharded = ("model/w", "model/b", "optim/0/exp_avg")
    replicas, sid, records = 2, new_save_id(), []
    for i in range(saved_k):
        mine, origins = {}, {}
        for name, t in whole.items():
            if name in sharded:
                first, part = _chunks(t, saved_k)[i]
                mine[name], origins[name] = part.clone(), (tuple(t.shape), first)
            elif i == 0:
                mine[name] = t.clone()
        specs = {n: (t.shape, t.dtype) for n, t in mine.items()}
        plans = plan_row_shards(specs, origins, replicas, first_index=i * replicas,
                                num_files=replicas * saved_k)
        records += [write_shard(str(tmp_path), 2, p.index, p.num_shards, take_share(mine, p),
                                save_id=sid) for p in plans]
    path = commit_checkpoint(str(tmp_path), 2, records, {"steps_done": 2},
                             world_size=len(records))
    manifest = read_manifest(path)
    assert {n: t.shape for n, t in manifest.tensors.items()} == {
        n: tuple(t.shape) for n, t in whole.items()}
    assert verify_checkpoint(path).ok
    back, _ = load_checkpoint(path)  # whole, as export reads it
    for name, t in whole.items():
        assert back[name].equal(t), name
    for i in range(read_k):
        rows = {n: (first, first + len(part))
                for n in sharded for first, part in [_chunks(whole[n], read_k)[i]]}
        into = {n: torch.full((b - a, *whole[n].shape[1:]), -1.0, dtype=whole[n].dtype)
                for n, (a, b) in rows.items()}
        got, _ = load_checkpoint(path, rows=rows, into=into)
        for name, (a, b) in rows.items():
            assert got[name].equal(whole[name][a:b]), (name, i)
            assert got[name].data_ptr() == into[name].data_ptr()  # filled in place
        assert got["optim/0/step"].equal(whole["optim/0/step"])


def test_a_copy_beside_the_caller_keeps_the_state_of_its_step_and_times_the_wait(tmp_path):
    """With a fence, start returns before the copy; a writer of the state that arrives
    meanwhile waits at the fence, so the shard holds the state as it was at start, and
    the wait is the save's blocked_s."""
    import threading

    from planaria.checkpoint.fence import CopyFence

    state = make_state()
    before = {k: v.clone() for k, v in state.items()}
    (plan,) = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, 1)
    gate = threading.Event()
    w = AsyncShardWriter(str(tmp_path), before_copy=lambda step: gate.wait(30))
    fence = CopyFence()
    w.start(1, state, plan, save_id=new_save_id(), fence=fence)
    assert w.copied_beside and fence.closed  # the copy waits at the gate: start did not

    def update() -> None:  # what an optimizer step does, after the fence
        fence.wait()
        state["model/big.weight"].add_(1.0)
        state["optim/3/exp_avg"].mul_(2.0)

    updater = threading.Thread(target=update)
    updater.start()
    while not fence.waiting:  # the update has reached the fence
        updater.join(0.001)
    gate.set()
    updater.join(30)
    record = w.result(timeout_s=30)
    assert not fence.closed and fence.blocked_s > 0 and w.last_copy_s is not None
    path = commit_checkpoint(str(tmp_path), 1, [record], {"step": 1}, world_size=1)
    saved, _ = load_checkpoint(path)
    assert_same(saved, before)
    assert not torch.equal(state["model/big.weight"], before["model/big.weight"])
    w.close()


def test_a_copy_beside_that_fails_opens_the_fence_and_fails_the_save(tmp_path) -> None:
    from planaria.checkpoint.fence import CopyFence

    state = make_state()
    (plan,) = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, 1)
    del state["optim/lr"]  # the plan names a tensor the state no longer has
    w = AsyncShardWriter(str(tmp_path))
    fence = CopyFence()
    with pytest.raises(KeyError):  # found while planning the slices, before the copy
        w.start(1, state, plan, fence=fence)
    assert not fence.closed

    def fail(step: int) -> None:
        raise OSError("staging failed")

    w = AsyncShardWriter(str(tmp_path), before_copy=fail)
    w.start(1, make_state(), plan, fence=fence)
    with pytest.raises(OSError, match="staging failed"):
        w.result(timeout_s=30)
    fence.wait()  # open again: returns
    assert not fence.closed and fence.blocked_s == 0.0
    assert list_checkpoints(str(tmp_path)) == []
    w.close()


def test_a_copy_beside_starts_at_its_go_or_when_a_writer_of_the_state_waits(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy waits for its go (the next step begins), so that it does not take the cores
    from the save call's reply; a writer of the state that reaches the fence first gives
    the go itself. With the fallback pushed past the test's timeouts, a missing go hangs."""
    import threading

    from planaria.checkpoint import fence as fence_module
    from planaria.checkpoint.fence import CopyFence

    monkeypatch.setattr(fence_module, "GO_AFTER_S", 600.0)
    (plan,) = plan_shards({n: (t.shape, t.dtype) for n, t in make_state().items()}, 1)
    copies: list[int] = []
    started = threading.Event()

    def before_copy(step: int) -> None:
        copies.append(step)
        started.set()

    w = AsyncShardWriter(str(tmp_path), before_copy=before_copy)
    fence = CopyFence()
    w.start(1, make_state(), plan, save_id=new_save_id(), fence=fence)
    assert fence.closed and copies == []  # waiting for its go
    fence.go()
    assert started.wait(30)
    w.result(timeout_s=30)
    assert copies == [1] and not fence.closed

    w.start(2, make_state(), plan, save_id=new_save_id(), fence=fence)
    fence.wait()  # no go given: the writer's wait gives it, and returns once copied
    assert copies == [1, 2] and not fence.closed
    w.result(timeout_s=30)
    w.close()
