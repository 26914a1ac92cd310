"""Checkpoints: replica-parallel, asynchronous, verified, on any fsspec storage.

Saving, per writer (one per replica or process)::

    plans = plan_shards({n: (t.shape, t.dtype) for n, t in tensors.items()}, num_writers)
    writer = AsyncShardWriter(root)
    writer.start(step, tensors, plans[i], save_id=save_id)  # blocks for the snapshot only
    record = writer.result(timeout_s=600)                   # ShardRecord, JSON-able

then once, with every writer's record::

    commit_checkpoint(root, step, records, meta, world_size=n)

Restoring: :func:`load_latest` (or :func:`latest_viable` + :func:`load_checkpoint`)
returns the newest committed checkpoint of a lineage (the runs whose checkpoints count)
whose checksums verify, with warnings for each newer one skipped. Errors are
:class:`planaria.faults.errors.CheckpointError`.
"""

from planaria.checkpoint.async_writer import AsyncShardWriter
from planaria.checkpoint.commit import commit_checkpoint
from planaria.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpoint,
    IncompleteCheckpoint,
    ManifestError,
)
from planaria.checkpoint.interval import CheckpointInterval, young_daly_interval
from planaria.checkpoint.layout import new_save_id
from planaria.checkpoint.manifest import Manifest, parse_manifest
from planaria.checkpoint.newest import latest_viable, load_latest
from planaria.checkpoint.plan import ShardPlan, SliceSpec, plan_row_shards, plan_shards
from planaria.checkpoint.restore import (
    CheckpointInfo,
    Restored,
    VerifyReport,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    verify_checkpoint,
)
from planaria.checkpoint.retention import apply_retention, clean_leftovers
from planaria.checkpoint.staging import StagingBuffers, take_share
from planaria.checkpoint.writer import ShardRecord, write_shard

__all__ = [
    "AsyncShardWriter",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointInterval",
    "CorruptCheckpoint",
    "IncompleteCheckpoint",
    "Manifest",
    "ManifestError",
    "Restored",
    "ShardPlan",
    "ShardRecord",
    "SliceSpec",
    "StagingBuffers",
    "VerifyReport",
    "apply_retention",
    "clean_leftovers",
    "commit_checkpoint",
    "latest_viable",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "new_save_id",
    "parse_manifest",
    "plan_row_shards",
    "plan_shards",
    "read_manifest",
    "take_share",
    "verify_checkpoint",
    "write_shard",
    "young_daly_interval",
]
