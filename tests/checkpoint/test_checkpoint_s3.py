"""The same code against a real S3-compatible server (moto, on loopback) through s3fs."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import s3fs
from moto.server import ThreadedMotoServer
from test_checkpoint_roundtrip import assert_same, make_state, save

from planaria.checkpoint import (
    apply_retention,
    clean_leftovers,
    latest_viable,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    plan_shards,
    read_manifest,
    take_share,
    verify_checkpoint,
    write_shard,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_options(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A moto S3 server on 127.0.0.1 and the storage options that reach it."""
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch_module.setenv(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port())
    server.start()
    host, port = server.get_host_and_port()
    options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing",
               }
    s3fs.S3FileSystem(**options).mkdir("ckpt-bucket")
    yield options
    server.stop()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_s3_round_trip(s3_options: dict[str, Any]) -> None:
    root = "s3://ckpt-bucket/run1"
    state = make_state()
    first = save(root, 1, state, 2, storage_options=s3_options)
    path = save(root, 2, state, 3, storage_options=s3_options)
    assert path == "s3://ckpt-bucket/run1/step_000000002"
    assert [c.step for c in list_checkpoints(root, storage_options=s3_options)] == [1, 2]
    tensors, meta = load_checkpoint(path, storage_options=s3_options)
    assert_same(tensors, state)
    assert meta["step"] == 2
    assert verify_checkpoint(path, storage_options=s3_options).ok
    sub, _ = load_checkpoint(path, names=["model/big.weight"], storage_options=s3_options)
    assert_same(sub, {"model/big.weight": state["model/big.weight"]})

    # corrupt an object: the older checkpoint is used, the warning names the file
    fs = s3fs.S3FileSystem(**s3_options)
    manifest = read_manifest(path, storage_options=s3_options)
    entry = manifest.tensors["model/emb"].slices[0]
    assert manifest.data_dir.startswith("save-")  # each save under its own prefix
    obj = f"ckpt-bucket/run1/step_000000002/{manifest.data_dir}/{entry.file}"
    data = bytearray(fs.cat_file(obj))
    data[entry.offsets[0]] ^= 0x01
    fs.pipe_file(obj, bytes(data))
    best, warnings = latest_viable(root, lineage=[None], storage_options=s3_options)
    assert best == first and entry.file in warnings[0]
    restored, _ = load_latest(root, lineage=[None], storage_options=s3_options)
    assert restored is not None and restored.step == 1


def test_s3_uncommitted_is_invisible_then_cleaned(s3_options: dict[str, Any]) -> None:
    root = "s3://ckpt-bucket/run2"
    state = make_state()
    save(root, 1, state, 2, storage_options=s3_options)
    plans = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, 2)
    write_shard(root, 5, 0, 2, take_share(state, plans[0]), storage_options=s3_options)
    infos = list_checkpoints(root, storage_options=s3_options)
    assert [(c.step, c.committed) for c in infos] == [(1, True), (5, False)]
    best, warnings = latest_viable(root, lineage=[None], storage_options=s3_options)
    assert best == "s3://ckpt-bucket/run2/step_000000001"
    assert "step 5" in warnings[0]
    assert clean_leftovers(root, storage_options=s3_options) == ["step_000000005"]
    save(root, 2, state, 2, storage_options=s3_options)
    save(root, 3, state, 2, storage_options=s3_options)
    assert apply_retention(root, keep_last=2, storage_options=s3_options) == [1]
    assert [c.step for c in list_checkpoints(root, storage_options=s3_options)] == [2, 3]


def test_s3_resave_killed_before_commit_keeps_the_committed_copy(
    s3_options: dict[str, Any],
) -> None:
    root = "s3://ckpt-bucket/run3"
    old = make_state(0)
    path = save(root, 4, old, 2, storage_options=s3_options)
    # A re-save of step 4 writes every shard, then dies before its commit.
    new = make_state(1)
    plans = plan_shards({n: (t.shape, t.dtype) for n, t in new.items()}, 2, split_bytes=40_000)
    for p in plans:
        write_shard(root, 4, p.index, 2, take_share(new, p), save_id="deadbeef",
                    storage_options=s3_options)
    assert verify_checkpoint(path, storage_options=s3_options).ok
    assert_same(load_checkpoint(path, storage_options=s3_options)[0], old)
    assert clean_leftovers(root, storage_options=s3_options) == ["step_000000004/save-deadbeef"]
    fs = s3fs.S3FileSystem(**s3_options)
    fs.invalidate_cache()
    kept = read_manifest(path, storage_options=s3_options).data_dir
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ckpt-bucket/run3/step_000000004")) == [
        "COMMITTED", kept]
    # A re-save that commits replaces the old copy and removes its files.
    save(root, 4, new, 2, storage_options=s3_options)
    assert_same(load_checkpoint(path, storage_options=s3_options)[0], new)
    fs.invalidate_cache()
    assert len(fs.ls("ckpt-bucket/run3/step_000000004")) == 2
