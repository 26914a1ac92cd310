"""The worker's side of a save: snapshot its share of the state, write it in the background.

The controller's :class:`planaria.checkpoint.coordinator.Checkpointer` calls these through
Ray. :meth:`CheckpointSaver.start` copies this replica's share of the state into
staging buffers kept from one save to the next and writes it from a background
thread. The copy itself runs beside the next step (``SaveOptions.copy_beside``):
the module buffers, which a forward changes, are cloned at once, and the next
update waits at the state's :class:`~planaria.checkpoint.fence.CopyFence` until the
parameters and the optimizer's state are copied: that wait is the save's stall on
training, reported with the shard (``blocked_s``); :meth:`CheckpointSaver.poll`
and :meth:`CheckpointSaver.wait` hand the shard's record to the controller,
which commits the checkpoint once it holds every record. Every replica computes
the same byte-balanced :func:`~planaria.checkpoint.plan_shards` plan from its own
(identical) tensor layout, so no plan crosses the wire.

A save may also be taken beside the steps, under a hold (before a preemption
wave): :meth:`CheckpointSaver.start_beside` snapshots the committed state while
the training thread may compute the next step (see :mod:`planaria.worker.commit`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from planaria.checkpoint import AsyncShardWriter, plan_shards
from planaria.checkpoint.plan import ShardPlan, plan_row_shards
from planaria.checkpoint.storage import Storage
from planaria.checkpoint.writer import ShardRecord
from planaria.faults.errors import PlanariaError
from planaria.faults.points import FaultPoints
from planaria.wire.state_reports import ShardWritten, Snapshot, StorageProbe
from planaria.worker.commit import Commits
from planaria.worker.replica_state import ReplicaState
from planaria.worker.state import jsonable, shard_origins
from planaria.worker.vitals import Vitals

__all__ = ["CheckpointSaver", "SaveOptions", "probe_storage"]


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How a save is written: the controller's settings, passed on every ``ckpt_start``."""

    root: str
    """Where the checkpoints live (a path or a URL)."""
    storage_options: Mapping[str, Any] | None
    """The storage's options (fsspec's), e.g. an S3 endpoint."""
    fsync: bool
    """Files are synced to stable storage before the shard counts as written."""
    attempts: int
    """How often a write that fails with a storage error is tried."""
    staging_budget_bytes: int | None
    """At most this much host memory stages the snapshot (None: the whole share)."""
    direct_io: bool
    """Written with O_DIRECT where the file system allows it."""
    copy_beside: bool = True
    """The copy into staging runs beside the next step (host tensors only); False: the
    call returns once it is done."""


class CheckpointSaver:
    """This worker's shard of each save, and the background writer that writes it."""

    def __init__(self, name: str, state: ReplicaState, commits: Commits, vitals: Vitals,
                 faults: FaultPoints) -> None:
        self.name = name
        self.state = state
        self.commits = commits
        self.vitals = vitals
        self.faults = faults
        self.writer: AsyncShardWriter | None = None
        self.writer_key: tuple[str, str, bool] | None = None
        self.save_id: str | None = None  # the save the writer writes

    def start(self, step: int, index: int, num_shards: int, save_id: str, options: SaveOptions,
              describe: dict[str, Any] | None) -> Snapshot:
        """Snapshots shard ``index`` of ``num_shards`` of the state after ``step`` steps and
        starts writing it; returns once the snapshot is taken (``busy``, and nothing saved,
        while the previous write still runs: the controller drops the save)."""
        self.state.refuse_if_dirty(self.name, "be saved")
        if self.writer is not None and self.writer.busy:
            # Never block in an actor call on the writer: the controller drops this save.
            return Snapshot(busy=True, nbytes=0, meta=None)
        commits = self.commits
        if commits.pending is not None or commits.steps_done != step:
            raise PlanariaError(
                f"{self.name} cannot snapshot step {step}: it has {commits.steps_done} steps "
                "done" + (f" and step {commits.pending} pending"
                          if commits.pending is not None else "")
            )
        self.vitals.set_phase("snapshot", step)
        tensors, meta = self.state.flatten()
        beside = options.copy_beside
        if beside:  # a forward changes the buffers in place: they are copied now
            buffers = {f"model/{n}" for n, _ in self.state.model.named_buffers()}
            tensors = {k: v.clone() if k in buffers else v for k, v in tensors.items()}
        return self._snapshot(step, index, num_shards, save_id, options, describe,
                              (tensors, meta), copy_beside=beside)

    def start_beside(self, step: int, index: int, num_shards: int, save_id: str,
                     options: SaveOptions, describe: dict[str, Any] | None) -> Snapshot:
        """As :meth:`start`, but beside the steps, under a hold: the committed state of step
        ``step`` is snapshotted while the training thread may be computing the next step
        (its module buffers, in flux, are taken as committed: see BufferSync.committed)."""
        state = self.state
        state.refuse_if_dirty(self.name, "be saved")
        with state.lock:
            if self.writer is not None and self.writer.busy:
                return Snapshot(busy=True, nbytes=0, meta=None)
            if self.commits.steps_done != step:
                raise PlanariaError(f"{self.name} cannot snapshot step {step} beside its steps: "
                                    f"it has {self.commits.steps_done} steps done")
            tensors, meta = state.flatten()
            committed = state.buffer_sync.committed()
            if committed:
                tensors = {**tensors, **{f"model/{k}": v for k, v in committed.items()
                                         if f"model/{k}" in tensors}}
            return self._snapshot(step, index, num_shards, save_id, options, describe,
                                  (tensors, meta), phase=False)

    def _snapshot(
        self, step: int, index: int, num_shards: int, save_id: str, options: SaveOptions,
        describe: dict[str, Any] | None, state: tuple[dict[str, torch.Tensor], dict[str, Any]],
        *, phase: bool = True, copy_beside: bool = False,
    ) -> Snapshot:
        """Copies this worker's share of ``state`` into the writer's staging and starts its
        write (see :meth:`start`)."""
        tensors, meta = state
        plan = self._plan(tensors, index, num_shards)
        writer = self._writer(options.root, options.storage_options, options.fsync)
        writer.attempts = options.attempts
        writer.staging_budget_bytes = options.staging_budget_bytes
        writer.direct = options.direct_io
        first = index == 0 and self.state.shape.shard_index == 0
        meta = self.state.with_extra_state(meta) if first else meta
        description = None
        if describe is not None and first:
            description = {**describe, "meta": {**jsonable(meta, "meta"), **describe["meta"]}}
        writer.start(step, tensors, plan, save_id=save_id, describe=description,
                     fence=self.state.copy_fence if copy_beside else None)
        self.save_id = save_id
        if phase:
            self.vitals.set_phase("idle", step)
        copy_s = 0.0 if writer.copied_beside else writer.last_copy_s or 0.0
        return Snapshot(busy=False, nbytes=plan.nbytes, meta=meta if first else None,
                        copy_s=copy_s)

    def _plan(self, tensors: Mapping[str, torch.Tensor], index: int, num_shards: int
              ) -> ShardPlan:
        """What this worker writes as writer ``index`` of ``num_shards`` replicas. A sharded
        replica's worker i writes its share of shard i (file ``i * num_shards + index`` of
        ``num_shards * k``), as rows of the whole tensors; the tensors every worker of a
        replica holds whole (Adam's step) are written by shard 0's workers only."""
        specs = {k: (t.shape, t.dtype) for k, t in tensors.items()}
        k, shard_index = self.state.shape.k, self.state.shape.shard_index
        if k == 1:
            return plan_shards(specs, num_shards)[index]
        origins = shard_origins(self.state.model, self.state.optimizer)
        if shard_index:
            specs = {n: v for n, v in specs.items() if n in origins}
        return plan_row_shards(specs, origins, num_shards,
                               first_index=shard_index * num_shards,
                               num_files=num_shards * k)[index]

    def _writing(self, save_id: str) -> AsyncShardWriter:
        writer = self.writer
        if writer is None or self.save_id != save_id:
            raise PlanariaError(f"{self.name} is not writing save {save_id}")
        return writer

    def poll(self, save_id: str) -> ShardWritten | None:
        """The shard record of save ``save_id`` once written (None while writing); raises
        the write's error if it failed."""
        writer = self._writing(save_id)
        self.state.copy_fence.go()  # the controller waits for the save: its copy starts
        record = writer.poll()
        if record is None:
            return None
        return self._written(writer, record)

    def wait(self, save_id: str, timeout_s: float) -> ShardWritten:
        """Waits until this worker's shard of save ``save_id`` is written and read back, and
        returns its record. Raises the write's error, or ``TimeoutError`` past
        ``timeout_s``."""
        writer = self._writing(save_id)
        self.state.copy_fence.go()
        return self._written(writer, writer.result(timeout_s))

    def _written(self, writer: AsyncShardWriter, record: ShardRecord) -> ShardWritten:
        beside = writer.copied_beside
        return ShardWritten(records=[record.to_dict()],
                            written_t=writer.last_written_t or time.time(),
                            copy_s=writer.last_copy_s or 0.0,
                            blocked_s=self.state.copy_fence.blocked_s if beside else 0.0)

    def _writer(self, root: str, storage_options: Mapping[str, Any] | None, fsync: bool
                ) -> AsyncShardWriter:
        key = (root, repr(sorted((storage_options or {}).items())), fsync)
        if self.writer is None or self.writer_key != key:
            if self.writer is not None:
                self.writer.close(timeout_s=300)
            self.writer = AsyncShardWriter(root, fsync=fsync, storage_options=storage_options,
                                           before_write=self._before_write,
                                           before_copy=self._before_copy)
            self.writer_key = key
        return self.writer


    def _before_write(self, step: int) -> None:
        if self.faults.armed:
            self.faults.hit("worker.shard_write", step=step)

    def _before_copy(self, step: int) -> None:
        if self.faults.armed:
            self.faults.hit("worker.stage_copy", step=step)


def probe_storage(root: str, name: str, storage_options: Mapping[str, Any] | None, size: int
                  ) -> StorageProbe:
    """Reads the file ``name`` the controller wrote under ``root``: ok, or an ``error`` (a
    root this worker cannot reach, e.g. a local path on another node)."""
    try:
        st = Storage(root, storage_options)
        got = len(st.read_bytes(st.path(name)))
    except Exception as err:
        return StorageProbe(error=f"{type(err).__name__}: {err}")
    if got != size:
        return StorageProbe(error=f"read {got} bytes of {name}, the controller wrote {size}")
    return StorageProbe()
