"""Committing a checkpoint once every shard is written: manifest, marker, rename."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from planaria._version import __version__
from planaria.checkpoint.errors import IncompleteCheckpoint, ManifestError
from planaria.checkpoint.layout import (
    MANIFEST,
    MARKER,
    save_dir_name,
    step_dir_name,
    trash_dir_name,
)
from planaria.checkpoint.manifest import (
    Manifest,
    SliceEntry,
    TensorEntry,
    marker_bytes,
    parse_manifest,
)
from planaria.checkpoint.storage import Storage
from planaria.checkpoint.writer import RecordedSlice, ShardRecord, shard_dir
from planaria.faults import points

__all__ = ["commit_checkpoint"]

_log = logging.getLogger("planaria.checkpoint")


def _check_records(step: int, records: Sequence[ShardRecord]) -> tuple[str, int]:
    if not records:
        raise IncompleteCheckpoint(f"step {step}: no shard records to commit")
    num = records[0].num_shards
    save_id = records[0].save_id
    for r in records:
        if r.step != step or r.num_shards != num or r.save_id != save_id:
            raise ManifestError(
                f"step {step}: shard record {r.shard_index} is for step {r.step}, save "
                f"{r.save_id!r}, {r.num_shards} shards; expected step {step}, save "
                f"{save_id!r}, {num} shards"
            )
    if len({r.checksum for r in records}) > 1:
        raise ManifestError(f"step {step}: shard records use different checksum algorithms")
    got = sorted(r.shard_index for r in records)
    if got != list(range(num)):
        missing = sorted(set(range(num)) - set(got))
        raise IncompleteCheckpoint(
            f"step {step}: shard records {got} do not cover 0..{num - 1}"
            + (f" (missing {missing})" if missing else " (duplicates)")
        )
    return save_id, num


def _tensor_entries(records: Sequence[ShardRecord]) -> dict[str, TensorEntry]:
    by_name: dict[str, list[tuple[RecordedSlice, str]]] = {}
    for r in records:
        for s in r.slices:
            by_name.setdefault(s.name, []).append((s, r.file.name))
    out: dict[str, TensorEntry] = {}
    for name in sorted(by_name):
        parts = sorted(by_name[name], key=lambda p: p[0].rows or (0, 0))
        first = parts[0][0]
        if any(s.dtype != first.dtype for s, _ in parts):
            raise ManifestError(f"tensor {name!r}: slices disagree on dtype")
        if first.rows is None:
            shape = first.shape
        else:
            if any(s.shape[1:] != first.shape[1:] for s, _ in parts):
                raise ManifestError(f"tensor {name!r}: row slices disagree on trailing shape")
            shape = (parts[-1][0].rows[1], *first.shape[1:])  # type: ignore[index]
        slices = tuple(SliceEntry(f, s.key, s.rows, s.offsets, s.crc32) for s, f in parts)
        out[name] = TensorEntry(first.dtype, tuple(shape), slices)
    return out


def commit_checkpoint(
    root: str,
    step: int,
    records: Sequence[ShardRecord],
    meta: Mapping[str, Any],
    *,
    world_size: int,
    user_metadata: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    run_id: str | None = None,
) -> str:
    """Commits the save of ``step`` whose writers returned ``records``; returns its path.

    Checks that there is one record per shard, all of one save, that every file
    exists with the recorded size and that the slices make whole tensors; then
    writes ``manifest.json``, then the commit marker, then (local disk) renames
    the temporary directory to ``step_XXXXXXXXX``, replacing an older directory
    of the same step. On object stores the manifest goes under the save's prefix
    and the marker, written last in one PUT, switches readers from an older
    commit of the step to this one; the older copy's files are removed after.
    ``meta`` must be JSON-serialisable; ``run_id`` (the run committing) goes in
    the marker. Raises
    :class:`IncompleteCheckpoint` or :class:`ManifestError` (subclasses of
    :class:`CheckpointError`) before anything becomes visible; storage errors
    propagate as raised.
    """
    save_id, _ = _check_records(step, records)
    storage = Storage(root, storage_options)
    directory = shard_dir(storage, step, save_id)
    ordered = sorted(records, key=lambda r: r.shard_index)
    for r in ordered:
        path = f"{directory}/{r.file.name}"
        try:
            size = storage.size(path)
        except FileNotFoundError as err:
            raise IncompleteCheckpoint(f"step {step}: shard file {path} is missing") from err
        if size != r.file.size:
            raise IncompleteCheckpoint(
                f"step {step}: {path} has {size} bytes, its writer recorded {r.file.size}"
            )
    manifest = Manifest(
        step=step,
        world_size=world_size,
        save_id=save_id,
        files=tuple(r.file for r in ordered),
        tensors=_tensor_entries(ordered),
        meta=dict(meta),
        user_metadata=dict(user_metadata or {}),
        planaria_version=__version__,
        torch_version=torch.__version__,
        created_t=time.time(),
        checksum=ordered[0].checksum,
    )
    if not storage.local:
        manifest = dataclasses.replace(manifest, data_dir=save_dir_name(save_id))
    data = manifest.to_json()
    parse_manifest(data)  # the reader's own checks, before anything becomes visible
    final = storage.path(step_dir_name(step))
    storage.write_bytes(f"{directory}/{MANIFEST}", data)
    points.hit("checkpoint.manifest_written", step=step)
    marker = marker_bytes(data, step, save_id, manifest.checksum, data_dir=manifest.data_dir,
                          run_id=run_id)
    if not storage.local:
        storage.write_bytes(f"{final}/{MARKER}", marker)  # the switch: one atomic PUT
        remove_stale_saves(storage, final, manifest.data_dir)
        return storage.url(final)
    storage.write_bytes(f"{directory}/{MARKER}", marker)
    points.hit("checkpoint.marker_written", step=step)
    if storage.local:
        storage.fsync_dir(directory)
        if storage.exists(final):
            _log.warning("replacing existing checkpoint directory %s", final)
            trash = storage.path(trash_dir_name(step))
            storage.rename(final, trash)
            points.hit("checkpoint.renamed", step=step)
            storage.rename(directory, final)
            points.hit("checkpoint.renamed", step=step)
            storage.fsync_dir(storage.root)
            storage.remove_tree(trash)
        else:
            storage.rename(directory, final)
            points.hit("checkpoint.renamed", step=step)
            storage.fsync_dir(storage.root)
    return storage.url(final)


def remove_stale_saves(storage: Storage, directory: str, data_dir: str) -> list[str]:
    """Object stores: deletes what other saves of this step left in its ``directory`` (older
    commits, re-saves that never committed), keeping the marker and the prefix
    ``data_dir`` it names ("": an old-layout commit, whose files lie in ``directory``
    itself). Returns the names removed; storage errors are logged, not raised (the
    next clean-up retries)."""
    removed = []
    for name in storage.listdir(directory):
        if name in (MARKER, data_dir):
            continue
        if not data_dir and not name.startswith("save-"):
            continue  # the committed old-layout files themselves
        try:
            storage.remove_tree(f"{directory}/{name}")
        except OSError as err:
            _log.warning("could not remove %s/%s: %s", directory, name, err)
            continue
        removed.append(name)
    return removed
