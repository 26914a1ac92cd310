"""What the workers answer the controller's calls about a replica's state: its setup
(``setup``), its description for a joiner (``state_meta``) and its checkpoints
(``ckpt_*``). One frozen dataclass per
report, merged across a sharded replica's workers as :mod:`planaria.wire.reports`' are
(the leader's first, then the others' in shard order); plain values only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from planaria.wire.reports import merge_checksums

__all__ = [
    "RestoreRead",
    "Setup",
    "ShardWritten",
    "Snapshot",
    "StateMeta",
    "StorageProbe",
    "merge_written",
]

Layout = Mapping[str, tuple[Sequence[int], str]]
"""Tensor name → (shape, dtype name without ``torch.``): enough to allocate its buffer."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    """A worker built (``Worker.setup``): where it runs, what it built (the parameters'
    checksum and bytes, the dataset's size and fingerprint, the global generators its
    ``dataset[i]`` draws from) and the timings of its start. A sharded replica's: the
    leader's, with every shard's checksum and bytes, and its other workers' pids."""

    pid: int
    node: str
    """The host's name."""
    ray_node: str | None
    """Ray's node id (None outside a Ray worker)."""
    init_t: float
    """When the process was up and had imported planaria (Unix time)."""
    start: Mapping[str, float | str]
    """How long each part of the setup took (``build_s``, ``data_s``, ``warm_s``: the
    forward and backward a replacement, a spare or a compiled model runs before its first
    step, ``compile_s``: that, where it compiles, ``prebuild_s``: a joiner's optimizer
    state, ``setup_s``), ``forked``: whether the process was forked from a warm one, and
    ``priority``: the CPU priority the setup ran at (``idle``, ``nice N``), ``reserve``:
    where a joiner's optimizer state's memory came from (``recycled``, ``new``, ``none``)."""
    checksum: int
    """The initial parameters' checksum (0 for a joiner: its state is sent to it, and the
    checksum is only compared between the job's first members)."""
    param_bytes: int
    num_samples: int
    data_fingerprint: Mapping[str, object]
    dataset_draws: Sequence[str]
    follower_pids: Sequence[int] = ()

    def merge(self, theirs: Sequence[Setup]) -> Setup:
        return replace(self, checksum=merge_checksums(self.checksum, [t.checksum for t in theirs]),
                       param_bytes=self.param_bytes + sum(t.param_bytes for t in theirs),
                       follower_pids=tuple(t.pid for t in theirs))


@dataclass(frozen=True, kw_only=True, slots=True)
class StateMeta:
    """What a joiner needs besides the tensors (``Worker.state_meta``): their layout, the
    state's JSON metadata (optimizer, scheduler, extra state), the steps done, and the
    tensors kept on the host (Adam's step counters beside CUDA parameters). A sharded
    replica's holds every worker's in ``shards``, for the joiner's workers in order.
    ``beside``: the state goes beside the next step (planaria.worker.transfer);
    ``by_memory``: a joiner on the source's node may read it out of the source's memory
    (planaria.worker.transfer_route; the controller sets it from ``RunConfig``)."""

    layout: Layout
    meta: dict[str, object]
    steps_done: int
    on_host: Sequence[str]
    shards: Sequence[StateMeta] = ()
    beside: bool = False
    by_memory: bool = False

    def merge(self, theirs: Sequence[StateMeta]) -> StateMeta:
        return replace(self, shards=(self, *theirs))

    def part(self, shard_index: int) -> StateMeta:
        """The description a joiner's worker ``shard_index`` receives."""
        return self.shards[shard_index] if self.shards else self

    def tensors(self) -> list[tuple[Sequence[int], str]]:
        """Every tensor's (shape, dtype name), every shard's."""
        return [spec for part in (self.shards or (self,)) for spec in part.layout.values()]


@dataclass(frozen=True, kw_only=True, slots=True)
class Snapshot:
    """A save's snapshot taken (``ckpt_start``, ``ckpt_start_beside``): the bytes this worker
    writes, and (the first writer's) the state's metadata. ``busy``: its writer still wrote
    an earlier save, and nothing was snapshotted (the controller drops the save). ``copy_s``:
    the seconds the copy into staging took in the worker (a sharded replica's: its slowest
    worker's), the part of the save's stall that is not the call's round trip; 0.0 when
    the copy runs beside the next step (then timed in ``ShardWritten``)."""

    busy: bool
    nbytes: int
    meta: dict[str, object] | None
    copy_s: float = 0.0

    def merge(self, theirs: Sequence[Snapshot]) -> Snapshot:
        parts = [self, *theirs]
        return replace(self, busy=any(p.busy for p in parts),
                       nbytes=sum(p.nbytes for p in parts),
                       copy_s=max(p.copy_s for p in parts))


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardWritten:
    """A save's shards written and read back (``ckpt_wait``, ``ckpt_poll``): their records
    (as the checkpoint's ``ShardRecord.to_dict`` writes them), a sharded replica's every
    worker's in shard order, and when the last was written (Unix time). ``copy_s``: the
    copy into staging (the slowest worker's); ``blocked_s``: how long the training waited
    for a copy that ran beside it (0.0 when it did not wait, or when the copy blocked the
    snapshot call instead: see ``Snapshot.copy_s``)."""

    records: Sequence[Mapping[str, object]]
    written_t: float
    copy_s: float = 0.0
    blocked_s: float = 0.0


def merge_written(
    mine: ShardWritten | None, theirs: Sequence[ShardWritten | None]
) -> ShardWritten | None:
    """A replica's shards once every worker's is written (None while one still writes)."""
    parts = [mine, *theirs]
    done = [p for p in parts if p is not None]
    if len(done) < len(parts):
        return None
    return ShardWritten(records=[r for p in done for r in p.records],
                        written_t=max(p.written_t for p in done),
                        copy_s=max(p.copy_s for p in done),
                        blocked_s=max(p.blocked_s for p in done))


@dataclass(frozen=True, kw_only=True, slots=True)
class StorageProbe:
    """Whether a worker read the file the controller wrote under a checkpoint root
    (``ckpt_probe``): ``error`` says why not (a root it cannot reach)."""

    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def merge(self, theirs: Sequence[StorageProbe]) -> StorageProbe:
        """The replica's first failure, if any."""
        return next((p for p in [self, *theirs] if not p.ok), self)


@dataclass(frozen=True, kw_only=True, slots=True)
class RestoreRead:
    """Phase 1 of a restore (``ckpt_read``): ``error`` (naming the file at fault) when the
    checkpoint is not usable, ``storage`` when that was a storage error (retried);
    ``mismatch`` names the tensors that differ from the replica's (with it, an error unless
    the restore is not strict: then only the tensors that match were read)."""

    error: str | None = None
    storage: bool = False
    mismatch: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def merge(self, theirs: Sequence[RestoreRead]) -> RestoreRead:
        """The replica's first failure, else the first mismatch, else the leader's."""
        parts = [self, *theirs]
        failed = next((p for p in parts if not p.ok), None)
        if failed is not None:
            return failed
        return next((p for p in parts if p.mismatch), self)
