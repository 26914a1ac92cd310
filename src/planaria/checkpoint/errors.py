"""The checkpoint library's errors: all are :class:`planaria.errors.CheckpointError`."""

from __future__ import annotations

from planaria.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "CorruptCheckpoint",
    "IncompleteCheckpoint",
    "ManifestError",
]


class ManifestError(CheckpointError):
    """A manifest, commit marker or shard record is malformed or inconsistent."""


class IncompleteCheckpoint(CheckpointError):
    """A checkpoint is not committed, or a file or shard it needs is missing."""


class CorruptCheckpoint(CheckpointError):
    """A file's size or a checksum disagrees with the manifest. The message names the file
    (and the tensor, where one is at fault)."""
