"""Names inside a checkpoint root: step directories, temporary directories, shards, markers.

A root holds one directory per step, ``step_000001200/``, with the shard files
``shard-00001-of-00003.safetensors``, ``manifest.json`` and the commit marker
``COMMITTED`` (written last). On local disk a save is written under
``step_000001200.tmp-<save_id>`` and renamed when complete; directories being
deleted are first renamed to ``step_000001200.trash-<id>``. On object stores a
save writes its shards and manifest under its own prefix,
``step_000001200/save-<save_id>/``, and the marker (one atomic PUT) names it: a
re-save of a step never touches the committed copy until its marker replaces
the old one.
"""

from __future__ import annotations

import re
import secrets

__all__ = [
    "MANIFEST",
    "MARKER",
    "new_save_id",
    "parse_dir_name",
    "save_dir_name",
    "shard_file_name",
    "step_dir_name",
    "tmp_dir_name",
    "trash_dir_name",
]

MANIFEST = "manifest.json"
MARKER = "COMMITTED"
DEFAULT_SAVE_ID = "0"

_STEP_RE = re.compile(r"^step_(\d{9,})(?:\.(tmp|trash)-([A-Za-z0-9_-]+))?$")
_SAVE_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def new_save_id() -> str:
    """A fresh random id naming one save attempt; give the same one to every writer of a save."""
    return secrets.token_hex(6)


def check_save_id(save_id: str) -> str:
    """Returns ``save_id`` if it is 1-64 characters of ``[A-Za-z0-9_-]``; ``ValueError`` if not."""
    if not isinstance(save_id, str) or not _SAVE_ID_RE.match(save_id):
        raise ValueError(f"save_id must match {_SAVE_ID_RE.pattern}, got {save_id!r}")
    return save_id


def step_dir_name(step: int) -> str:
    """``step_000001200`` for step 1200."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:09d}"


def tmp_dir_name(step: int, save_id: str) -> str:
    """The temporary name a save of ``step`` is written under on local disk."""
    return f"{step_dir_name(step)}.tmp-{check_save_id(save_id)}"


def save_dir_name(save_id: str) -> str:
    """The prefix, under a step's directory on object stores, a save's files go to."""
    return f"save-{check_save_id(save_id)}"


def trash_dir_name(step: int) -> str:
    """A fresh name a directory is renamed to before it is deleted."""
    return f"{step_dir_name(step)}.trash-{new_save_id()}"


def shard_file_name(index: int, num_shards: int) -> str:
    """``shard-00001-of-00003.safetensors`` for index 0 of 3 (file numbers are 1-based)."""
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} out of range for {num_shards} shards")
    return f"shard-{index + 1:05d}-of-{num_shards:05d}.safetensors"


def parse_dir_name(name: str) -> tuple[int, str] | None:
    """``(step, kind)`` for a step directory's name (kind: ``final``, ``tmp`` or ``trash``),
    None for any other name."""
    m = _STEP_RE.match(name)
    if m is None:
        return None
    return int(m.group(1)), m.group(2) or "final"
