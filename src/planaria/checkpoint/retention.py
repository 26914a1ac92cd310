"""Deleting old checkpoints and the leftovers of crashed saves."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from planaria.checkpoint.layout import MARKER, parse_dir_name, trash_dir_name
from planaria.checkpoint.restore import list_checkpoints, verify_checkpoint
from planaria.checkpoint.storage import Storage

__all__ = ["apply_retention", "clean_leftovers"]

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


def apply_retention(
    root: str,
    *,
    keep_last: int,
    keep_every: int | None = None,
    verify_newest: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> list[int]:
    """Deletes committed checkpoints under ``root`` except the ``keep_last`` newest and
    those whose step is a multiple of ``keep_every``; returns the steps deleted.

    The newest checkpoint that verifies is never deleted: with ``verify_newest``
    committed checkpoints are verified newest first until one passes (reading it
    in full), and that one is kept whatever the other rules say. Without it the
    newest committed one stands in for it. Uncommitted directories are left to
    :func:`clean_leftovers`.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
    st = Storage(root, storage_options)
    committed = [c for c in list_checkpoints(root, storage_options=storage_options)
                 if c.committed]
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


def clean_leftovers(
    root: str, *, storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """Removes what crashed saves and deletions left under ``root``: temporary and trash
    directories, and step directories without a commit marker. Never touches a
    committed checkpoint. Call it when no save is in progress (at job start): on
    object stores a save in progress looks exactly like an uncommitted leftover.
    Returns the names removed.
    """
    st = Storage(root, storage_options)
    removed = []
    for name in st.listdir():
        parsed = parse_dir_name(name)
        if parsed is None:
            continue
        path = st.path(name)
        if parsed[1] == "final" and st.exists(f"{path}/{MARKER}"):
            continue
        _log.info("removing leftover %s", path)
        st.remove_tree(path)
        removed.append(name)
    return removed
