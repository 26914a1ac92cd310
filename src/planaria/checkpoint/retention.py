"""Deleting old checkpoints and the leftovers of crashed saves."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from planaria.checkpoint.commit import remove_stale_saves
from planaria.checkpoint.errors import CheckpointError
from planaria.checkpoint.layout import (
    MANIFEST,
    MARKER,
    parse_dir_name,
    save_dir_name,
    step_dir_name,
    trash_dir_name,
)
from planaria.checkpoint.manifest import marker_fields, parse_marker
from planaria.checkpoint.restore import (
    CheckpointInfo,
    list_checkpoints,
    read_run_id,
    verify_checkpoint,
)
from planaria.checkpoint.storage import Storage

__all__ = ["apply_retention", "clean_leftovers", "delete_checkpoint", "of_runs",
           "remove_uncommitted_save"]


def remove_uncommitted_save(storage: Storage, step: int, save_id: str) -> bool:
    """Object stores: deletes the files a save of ``step`` that will not commit left under
    its step's prefix (a failed or abandoned save), never those its step's marker commits
    (a marker that cannot be read: nothing is deleted, the next job's clean-up decides).
    Returns whether it deleted."""
    directory = storage.path(step_dir_name(step))
    data_dir = save_dir_name(save_id)
    try:
        committed: str | None = marker_fields(storage.read_bytes(f"{directory}/{MARKER}"))[0]
    except FileNotFoundError:
        committed = None
    except Exception:  # unreadable, or the storage failed: keep it
        return False
    if committed == data_dir:
        return False
    storage.remove_tree(f"{directory}/{data_dir}")
    return True

_log = logging.getLogger("planaria.checkpoint")


def _delete(st: Storage, name: str, step: int) -> None:
    """Deletes a step directory so that no reader ever sees it half deleted as committed."""
    path = st.path(name)
    if st.local:
        trash = st.path(trash_dir_name(step))
        st.rename(path, trash)  # atomic: gone from the final name in one step
        st.fsync_dir(st.root)
        st.remove_tree(trash)
    else:
        st.remove(f"{path}/{MARKER}")  # uncommitted first, then the rest
        st.remove_tree(path)


def delete_checkpoint(st: Storage, info: CheckpointInfo) -> None:
    """Deletes the checkpoint ``info`` lists (uncommitted first, so never seen half gone)."""
    _log.info("deleting checkpoint of step %d (%s)", info.step, info.path)
    _delete(st, info.path.rstrip("/").rsplit("/", 1)[-1], info.step)


def apply_retention(
    root: str,
    *,
    keep_last: int,
    keep_every: int | None = None,
    verify_newest: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    run_ids: Collection[str | None] | None = None,
) -> list[int]:
    """Deletes committed checkpoints under ``root`` except the ``keep_last`` newest and
    those whose step is a multiple of ``keep_every``; returns the steps deleted.

    The newest checkpoint that verifies is never deleted: with ``verify_newest``
    committed checkpoints are verified newest first until one passes (reading it
    in full), and that one is kept whatever the other rules say. Without it the
    newest committed one stands in for it (right when every writer verified its
    shard as it wrote it, as a running job's do). Uncommitted directories are left
    to :func:`clean_leftovers`. With ``run_ids`` only checkpoints committed by those
    runs (a lineage; None stands for markers that name no run) are considered:
    another run's checkpoints are never ranked, kept or deleted.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
    st = Storage(root, storage_options)
    committed = [c for c in list_checkpoints(root, storage_options=storage_options)
                 if c.committed]
    if run_ids is not None:
        committed = of_runs(committed, run_ids, storage_options)
    keep = {c.step for c in committed[-keep_last:]}
    if keep_every is not None:
        keep |= {c.step for c in committed if c.step % keep_every == 0}
    for c in reversed(committed):
        if not verify_newest or verify_checkpoint(c.path, storage_options=storage_options).ok:
            keep.add(c.step)
            break
    deleted = []
    for c in committed:
        if c.step not in keep:
            _log.info("retention: deleting checkpoint of step %d (%s)", c.step, c.path)
            _delete(st, c.path.rstrip("/").rsplit("/", 1)[-1], c.step)
            deleted.append(c.step)
    return deleted


def of_runs(
    infos: list[CheckpointInfo],
    run_ids: Collection[str | None],
    storage_options: Mapping[str, Any] | None = None,
) -> list[CheckpointInfo]:
    """The committed checkpoints of ``infos`` whose marker names one of ``run_ids``."""
    out = []
    for c in infos:
        try:
            if read_run_id(c.path, storage_options=storage_options) in run_ids:
                out.append(c)
        except CheckpointError:
            continue  # unreadable: not known to be ours
    return out


def _valid_marker(st: Storage, path: str) -> bool:
    """True if ``path`` holds a marker that commits the manifest beside it."""
    try:
        marker = st.read_bytes(f"{path}/{MARKER}")
        data_dir, _ = marker_fields(marker)
        manifest = st.read_bytes(f"{path}/{data_dir}/{MANIFEST}" if data_dir
                                 else f"{path}/{MANIFEST}")
        parse_marker(marker, manifest)
    except (OSError, CheckpointError):
        return False
    return True


def clean_leftovers(
    root: str, *, storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """Removes what crashed saves and deletions left under ``root``: temporary and trash
    directories, step directories without a commit marker, and (object stores) the
    prefixes of saves of a committed step that its marker does not name. Never
    touches a committed checkpoint; a local temporary directory that holds a
    valid marker while its step has no final directory (a crash between the two
    renames of a replacing save) is renamed into place instead. Call it when no
    save is in progress (at job start): on object stores a save in progress looks
    exactly like an uncommitted leftover. Returns the names removed.
    """
    st = Storage(root, storage_options)
    removed = []
    names = st.listdir()
    for name in names:
        parsed = parse_dir_name(name)
        if parsed is None or parsed[1] != "tmp" or not st.local:
            continue
        final = step_dir_name(parsed[0])
        if final not in names and _valid_marker(st, st.path(name)):
            _log.warning("promoting %s: its save committed, the rename into place did not "
                         "happen", st.path(name))
            st.rename(st.path(name), st.path(final))
            st.fsync_dir(st.root)
    names = st.listdir()
    for name in names:
        parsed = parse_dir_name(name)
        if parsed is None:
            continue
        path = st.path(name)
        if parsed[1] == "final" and st.exists(f"{path}/{MARKER}"):
            if not st.local:
                try:
                    data_dir, _ = marker_fields(st.read_bytes(f"{path}/{MARKER}"))
                except (OSError, CheckpointError):
                    continue
                removed += [f"{name}/{n}" for n in remove_stale_saves(st, path, data_dir)]
            continue
        _log.info("removing leftover %s", path)
        st.remove_tree(path)
        removed.append(name)
    return removed
