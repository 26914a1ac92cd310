"""Corrupt, torn and malformed checkpoints are never used; the warnings say why."""

from __future__ import annotations

import itertools
import json
import os
import shutil

import pytest
import torch
from test_checkpoint_roundtrip import assert_same, make_state, save

from planaria.checkpoint import (
    CheckpointError,
    CorruptCheckpoint,
    IncompleteCheckpoint,
    ManifestError,
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
from planaria.checkpoint.manifest import marker_bytes
from planaria.faults.errors import PlanariaError


def flip_bit(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def test_errors_are_rooted() -> None:
    assert issubclass(CorruptCheckpoint, CheckpointError)
    assert issubclass(CheckpointError, PlanariaError)


def test_flipped_bit_is_detected_and_latest_viable_falls_back(tmp_path) -> None:
    root = str(tmp_path)
    old = save(root, 10, make_state(0), 3)
    new = save(root, 20, make_state(1), 3)
    manifest = read_manifest(new)
    entry = manifest.tensors["model/big.weight"].slices[1]
    flip_bit(os.path.join(new, entry.file), entry.offsets[0] + 5)

    report = verify_checkpoint(new)
    assert not report.ok
    assert entry.file in report.problems[0] and "model/big.weight" in report.problems[0]
    with pytest.raises(CorruptCheckpoint, match=entry.file):
        load_checkpoint(new)
    load_checkpoint(new, verify=False)  # the caller may opt out

    path, warnings = latest_viable(root, lineage=[None])
    assert path == old
    assert len(warnings) == 1 and entry.file in warnings[0] and "model/big.weight" in warnings[0]
    restored, warnings2 = load_latest(root, lineage=[None])
    assert restored is not None and restored.path == old and restored.step == 10
    assert_same(restored.tensors, make_state(0))
    assert entry.file in warnings2[0]


def test_flipped_header_bit_is_detected(tmp_path) -> None:
    path = save(str(tmp_path), 1, make_state(), 2)
    flip_bit(os.path.join(path, "shard-00002-of-00002.safetensors"), 20)
    report = verify_checkpoint(path)
    assert not report.ok and "shard-00002-of-00002.safetensors: header" in report.problems[0]


def test_truncated_or_missing_shard(tmp_path) -> None:
    root = str(tmp_path)
    old = save(root, 1, make_state(), 2)
    new = save(root, 2, make_state(), 2)
    shard = os.path.join(new, "shard-00001-of-00002.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptCheckpoint, match="bytes"):
        load_checkpoint(new)
    os.remove(shard)
    with pytest.raises(IncompleteCheckpoint, match="missing"):
        load_checkpoint(new)
    path, warnings = latest_viable(root, lineage=[None])
    assert path == old and "shard-00001-of-00002.safetensors" in warnings[0]


def torn_saves(root: str) -> None:
    """Leaves the three shapes a crashed save can leave on local disk."""
    state = make_state()
    plans = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, 2)
    # a temporary directory with every shard but no commit
    for p in plans:
        write_shard(root, 30, p.index, 2, take_share(state, p), save_id="crashed")
    # a final-named directory without its marker (as on object stores)
    committed = save(root, 40, state, 2)
    os.remove(os.path.join(committed, "COMMITTED"))
    # a final-named directory missing a shard, whose marker is there
    other = save(root, 50, state, 2)
    os.remove(os.path.join(other, "shard-00002-of-00002.safetensors"))


def test_torn_saves_are_never_returned(tmp_path) -> None:
    root = str(tmp_path)
    good = save(root, 20, make_state(), 2)
    torn_saves(root)
    path, warnings = latest_viable(root, lineage=[None])
    assert path == good
    assert any("step 40" in w and "not committed" in w for w in warnings)
    assert any("step 50" in w and "shard-00002-of-00002" in w for w in warnings)
    with pytest.raises(IncompleteCheckpoint, match="not committed"):
        load_checkpoint(os.path.join(root, "step_000000040"))
    assert [c.step for c in list_checkpoints(root)] == [20, 40, 50]
    removed = clean_leftovers(root)
    assert sorted(removed) == ["step_000000030.tmp-crashed", "step_000000040"]
    assert [c.step for c in list_checkpoints(root)] == [20, 50]  # committed ones stay
    assert load_checkpoint(good)[1]["step"] == 20


def test_nothing_viable(tmp_path) -> None:
    assert latest_viable(str(tmp_path), lineage=[None]) == (None, [])
    assert latest_viable(str(tmp_path / "missing"), lineage=[None]) == (None, [])
    torn_saves(str(tmp_path))
    path, warnings = latest_viable(str(tmp_path), lineage=[None])
    assert path is None and len(warnings) == 2
    assert load_latest(str(tmp_path), lineage=[None])[0] is None


def rewrite_manifest(path: str, edit) -> None:  # type: ignore[no-untyped-def]
    """Applies ``edit`` to the manifest and re-commits it, as a forger would."""
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        doc = json.load(f)
    edit(doc)
    data = json.dumps(doc).encode()
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(data)
    with open(os.path.join(path, "COMMITTED"), "wb") as f:
        f.write(marker_bytes(data, doc["step"], doc["save_id"]))


def _first_slice(doc: dict) -> dict:  # type: ignore[type-arg]
    return doc["tensors"]["model/big.weight"]["slices"][0]


EDITS = {
    "absolute path": lambda d: (d["files"][0].update(name="/etc/passwd"),
                                _first_slice(d).update(file="/etc/passwd")),
    "dotdot": lambda d: _first_slice(d).update(file="../step_000000001/x.safetensors"),
    "unknown dtype": lambda d: d["tensors"]["model/layer.bias"].update(dtype="F128"),
    "shape mismatch": lambda d: d["tensors"]["model/layer.bias"].update(shape=[97]),
    "rows gap": lambda d: _first_slice(d)["rows"].__setitem__(1, _first_slice(d)["rows"][1] - 1),
    "file size": lambda d: d["files"][0].update(size=d["files"][0]["size"] + 4),
    "format": lambda d: d.update(format_version=99),
    "step": lambda d: d.update(step=3),
}


@pytest.mark.parametrize("what", sorted(EDITS))
def test_bad_manifests_are_rejected(tmp_path, what: str) -> None:
    path = save(str(tmp_path), 2, make_state(), 3)
    rewrite_manifest(path, EDITS[what])
    with pytest.raises(ManifestError):
        load_checkpoint(path)
    assert not verify_checkpoint(path).ok
    assert latest_viable(str(tmp_path), lineage=[None])[0] is None


def test_manifest_file_size_disagrees_with_disk(tmp_path) -> None:
    path = save(str(tmp_path), 2, make_state(), 3)
    shard = os.path.join(path, "shard-00003-of-00003.safetensors")
    with open(shard, "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(CorruptCheckpoint, match=r"shard-00003-of-00003\.safetensors"):
        load_checkpoint(path)


def test_marker_must_match_manifest(tmp_path) -> None:
    path = save(str(tmp_path), 2, make_state(), 2)
    with open(os.path.join(path, "manifest.json"), "ab") as f:
        f.write(b" ")
    with pytest.raises(ManifestError, match="marker"):
        read_manifest(path)


def test_copied_checkpoint_stays_loadable(tmp_path) -> None:
    path = save(str(tmp_path / "a"), 2, make_state(), 2)
    copy = str(tmp_path / "b" / "step_000000002")
    shutil.copytree(path, copy)
    assert_same(load_checkpoint(copy)[0], make_state())
    assert torch.equal(load_checkpoint(copy, names=["optim/3/step"])[0]["optim/3/step"],
                       torch.tensor(17))


def test_slice_key_used_in_two_files_is_rejected(tmp_path) -> None:
    path = save(str(tmp_path), 2, make_state(), 3)

    def reuse_key(doc: dict) -> None:  # type: ignore[type-arg]
        slices = [(name, s) for name, t in doc["tensors"].items() for s in t["slices"]]
        (_, a), (_, b) = next(((x, y) for x, y in itertools.combinations(slices, 2)
                               if x[1]["file"] != y[1]["file"]))
        b["key"] = a["key"]  # a loader filling slices by key would leave one tensor unread

    rewrite_manifest(path, reuse_key)
    with pytest.raises(ManifestError, match="used twice"):
        load_checkpoint(path)
    assert not verify_checkpoint(path).ok


def test_huge_shape_is_refused_before_allocating(tmp_path, monkeypatch) -> None:
    path = save(str(tmp_path), 2, make_state(), 1)
    rows = 1 << 36  # 2**36 x 96 float32: 24 TiB

    def grow(doc: dict) -> None:  # type: ignore[type-arg]
        t = doc["tensors"]["model/big.weight"]
        extra = (rows - t["shape"][0]) * 96 * 4
        t["shape"][0] = rows
        s = t["slices"][-1]
        s["rows"][1] = rows if s["rows"] is not None else None
        s["offsets"][1] += extra
        for other in doc["tensors"].values():  # later slices in the file move up
            for o in other["slices"]:
                if o is not s and o["offsets"][0] >= s["offsets"][1] - extra:
                    o["offsets"] = [o["offsets"][0] + extra, o["offsets"][1] + extra]
        doc["files"][0]["size"] += extra

    rewrite_manifest(path, grow)
    big = []
    real_empty = torch.empty

    def watch(*shape, **kw):  # type: ignore[no-untyped-def]
        t = real_empty(*shape, **kw) if not big else None
        dims = shape[0] if shape and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        if dims and dims[0] >= rows:
            big.append(dims)
            raise AssertionError(f"allocated {dims}")
        return t if t is not None else real_empty(*shape, **kw)

    monkeypatch.setattr(torch, "empty", watch)
    with pytest.raises(CorruptCheckpoint, match="bytes, the manifest says"):
        load_checkpoint(path)
    assert not big


def test_crash_between_the_two_renames_keeps_the_step(tmp_path) -> None:
    root = str(tmp_path / "root")
    save(root, 2, make_state(0), 2)
    final = os.path.join(root, "step_000000002")
    # A re-save of step 2 committed in its temporary directory; the crash hit after the old
    # directory was renamed to the trash and before the new one was renamed into place.
    new = save(str(tmp_path / "other"), 2, make_state(1), 2)
    shutil.move(new, os.path.join(root, "step_000000002.tmp-abc"))
    os.rename(final, os.path.join(root, "step_000000002.trash-def"))
    assert latest_viable(root, lineage=[None])[0] is None
    clean_leftovers(root)
    assert sorted(os.listdir(root)) == ["step_000000002"]
    assert_same(load_checkpoint(final)[0], make_state(1))
