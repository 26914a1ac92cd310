"""The checkpoint library's errors: all are :class:`planaria.faults.errors.CheckpointError`."""

from __future__ import annotations

from planaria.faults.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "CheckpointMismatch",
    "CorruptCheckpoint",
    "IncompleteCheckpoint",
    "LeaseHeld",
    "ManifestError",
    "NoViableCheckpoint",
    "OtherRunCheckpoints",
]


class ManifestError(CheckpointError):
    """A manifest, commit marker or shard record is malformed or inconsistent."""


class IncompleteCheckpoint(CheckpointError):
    """A checkpoint is not committed, or a file or shard it needs is missing."""


class CorruptCheckpoint(CheckpointError):
    """A file's size or a checksum disagrees with the manifest. The message names the file
    (and the tensor, where one is at fault)."""


class NoViableCheckpoint(CheckpointError):
    """Committed checkpoints of this run's lineage exist but none verifies and loads: the
    message says what was wrong with each. Never a silent start from step 0."""


class OtherRunCheckpoints(CheckpointError):
    """A run that does not resume found another run's checkpoints under its root; the
    message says how to overwrite them or to branch off beside them."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint does not fit the job: tensors missing on either side, shapes or dtypes
    that differ, or another data plan. The message names them."""


class LeaseHeld(CheckpointError):
    """Another controller holds (or took over) the lease on a checkpoint root."""
