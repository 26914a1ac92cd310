"""The worker's side of checkpoints (snapshot its share, write it in the background, load).

The controller's :class:`planaria.checkpointing.Checkpointer` calls these through
Ray. Saving: :meth:`CheckpointWorkerMixin.ckpt_start` copies this replica's share
of the state into staging buffers kept from one save to the next (the only part
that stalls training) and writes it from a background thread;
:meth:`~CheckpointWorkerMixin.ckpt_poll` hands the shard's record to the
controller, which commits the checkpoint once it holds every record. Every
replica computes the same byte-balanced :func:`~planaria.checkpoint.plan_shards`
plan from its own (identical) tensor layout, so no plan crosses the wire.

Restoring is two-phase: :meth:`~CheckpointWorkerMixin.ckpt_read` reads (and
verifies) tensors straight into the replica's live tensors (memory already
allocated and touched: reading into fresh memory costs more in page faults than
the read itself), :meth:`~CheckpointWorkerMixin.ckpt_apply` then loads the rest
(optimizer and scheduler metadata), after broadcasting each tensor from the
replica that read it when the replicas read shares. Before reading, the
checkpoint's tensors (names, shapes, dtypes) are compared with the replica's: a
mismatch is reported and nothing is read. A read that fails leaves the replica's
state partly overwritten: the replica is ``ckpt_dirty`` until a restore
completes, and a dirty replica refuses to step, to send its state and to be
saved. Storage errors are reported as such (the controller retries them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from planaria.checkpoint import (
    AsyncShardWriter,
    CheckpointError,
    Manifest,
    load_checkpoint,
    plan_shards,
    read_manifest,
)
from planaria.checkpoint.backoff import is_storage_error
from planaria.checkpoint.compat import compare_layouts
from planaria.checkpoint.device_load import load_to_device
from planaria.checkpoint.dtypes import DTYPES, dtype_name
from planaria.checkpoint.plan import ShardPlan, plan_row_shards
from planaria.checkpoint.storage import Storage
from planaria.errors import PlanariaError
from planaria.faults import user_call
from planaria.replica import (
    fans_out,
    lane,
    merge_ckpt_apply,
    merge_ckpt_poll,
    merge_ckpt_read,
    merge_ckpt_start,
    merge_hold,
    merge_probe,
)
from planaria.state import _jsonable, flatten_state, load_state, model_checksum, shard_origins

if TYPE_CHECKING:
    from planaria.collective import Collective
    from planaria.config import TrainSpec

__all__ = ["CheckpointWorkerMixin", "broadcast_units"]

_log = logging.getLogger("planaria.checkpoint")
SMALL_TENSOR_BYTES = 1 << 20  # smaller ones are broadcast coalesced (one buffer per owner, dtype)


def broadcast_units(
    layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]], owners: Mapping[str, int]
) -> list[tuple[int, list[str]]]:
    """The order tensors are broadcast in on restore: ``(owner rank, names)`` per buffer.

    Big tensors go one by one, small ones coalesced per (owner, dtype); every rank
    computes the same list from the same manifest.
    """
    units: list[tuple[int, list[str]]] = []
    small: dict[tuple[int, str], list[str]] = {}
    for name in sorted(layout):
        shape, dtype = layout[name]
        nbytes = _numel(shape) * dtype.itemsize
        if nbytes >= SMALL_TENSOR_BYTES:
            units.append((owners[name], [name]))
        else:
            small.setdefault((owners[name], str(dtype)), []).append(name)
    units += [(owner, names) for (owner, _), names in sorted(small.items())]
    return units


def _read_failure(err: Exception) -> dict[str, Any]:
    """What :meth:`CheckpointWorkerMixin.ckpt_read` reports for an error while reading."""
    if isinstance(err, CheckpointError):
        return {"ok": False, "error": str(err)}
    if is_storage_error(err):
        return {"ok": False, "storage": True, "error": f"{type(err).__name__}: {err}"}
    raise err


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class CheckpointWorkerMixin:
    """Mixed into :class:`planaria.worker.Worker`; called by the controller's Checkpointer."""

    if TYPE_CHECKING:  # provided by Worker
        spec: TrainSpec
        name: str
        k: int
        shard_index: int
        model: torch.nn.Module
        optimizer: Any
        scheduler: Any
        steps_done: int
        pending: int | None
        progress: int
        comm: Collective | None
        skipped_samples: frozenset[int]

        def _check(self, gen: int) -> None: ...
        _state_lock: Any
        _hold: Any
        _hold_below: int | None
        _reduced_step: int
        _aborted_gen: int
        gen: int
        buffer_sync: Any
        def _drop_pending(self) -> None: ...
        def _prebuild_optimizer_state(self) -> None: ...
        def _set_phase(self, phase: str, step: int) -> None: ...

    _ckpt_writer: AsyncShardWriter | None = None
    _ckpt_writer_key: tuple[str, str, bool] | None = None
    _ckpt_save_id: str | None = None
    _ckpt_staged: tuple[str, dict[str, torch.Tensor], dict[str, Any],
                        dict[str, tuple[tuple[int, ...], torch.dtype]]] | None = None
    _ckpt_live: dict[str, torch.Tensor] | None = None
    ckpt_dirty: bool = False
    """A restore wrote into the live state and did not finish: the state is not to be used."""

    def _extra_state_get(self, meta: dict[str, Any]) -> dict[str, Any]:
        """``meta`` with the spec's extra state added (``extra_state``), if it has one."""
        hook = self.spec.extra_state
        if hook is not None:
            meta["extra_state"] = _jsonable(user_call("extra_state get", hook[0], self.model,
                                                  self.optimizer), "extra_state")
        scaler = getattr(self, "scaler", None)
        if scaler is not None:  # fp16: the loss scale and its growth tracker travel too
            meta["grad_scaler"] = scaler.state_dict()
        return meta

    def _extra_state_set(self, meta: Mapping[str, Any]) -> None:
        """Hands the extra state in ``meta`` (if any) to the spec's setter."""
        hook = self.spec.extra_state
        if hook is not None and isinstance(meta.get("extra_state"), dict):
            user_call("extra_state set", hook[1], self.model, self.optimizer, meta["extra_state"])
        scaler = getattr(self, "scaler", None)
        if scaler is not None and isinstance(meta.get("grad_scaler"), dict):
            scaler.load_state_dict(meta["grad_scaler"])

    def _refuse_if_dirty(self, what: str) -> None:
        """Raises if a restore left this replica's state half written."""
        if self.ckpt_dirty:
            raise PlanariaError(f"{self.name} cannot {what}: a restore into it did not finish, "
                                "its state is partly overwritten")

    # ---- saving ------------------------------------------------------------------------------

    @fans_out(merge_ckpt_start)
    def ckpt_start(
        self,
        gen: int,
        step: int,
        index: int,
        num_shards: int,
        save_id: str,
        root: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        fsync: bool = True,
        attempts: int = 3,
        staging_budget_bytes: int | None = None,
        direct_io: bool = True,
        describe: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Snapshots shard ``index`` of ``num_shards`` of the state after ``step`` steps and
        starts writing it under ``root``; returns once the snapshot is taken. ``describe``
        (writer 0's: the save's description with the controller's metadata) is written
        beside the shards, with this worker's metadata added, before the shard.

        The state must be settled (the controller calls ``commit`` first). Returns
        ``stall_s`` (seconds the snapshot blocked), ``bytes`` of the share and, from shard
        0, the state's JSON ``meta``; ``busy`` (and nothing saved) while this worker's
        previous write still runs: the controller drops the save.
        """
        self._check(gen)
        self._refuse_if_dirty("be saved")
        if self._ckpt_writer is not None and self._ckpt_writer.busy:
            # Never block in an actor call on the writer: the controller drops this save.
            return {"busy": True, "stall_s": None, "bytes": 0, "meta": None}
        if self.pending is not None or self.steps_done != step:
            raise PlanariaError(
                f"{self.name} cannot snapshot step {step}: it has {self.steps_done} steps done"
                + (f" and step {self.pending} pending" if self.pending is not None else "")
            )
        self._set_phase("snapshot", step)
        return self._snapshot(step, index, num_shards, save_id, root, storage_options,
                              fsync, attempts, staging_budget_bytes, direct_io,
                              describe, flatten_state(self.model, self.optimizer,
                                                      self.scheduler))

    # ---- a save beside the steps (before a preemption wave) -----------------------------------

    @fans_out(merge_hold)
    @lane("ckpt")
    def ckpt_freeze(self, gen: int) -> dict[str, Any]:
        """Beside the steps: no step from now on is applied (a hold) until ckpt_advance or
        ckpt_release; returns ``steps_done`` and whether the pending step is reduced here.
        The training thread goes on computing and waits, before its next apply, in phase
        ``held``; an abort of the generation drops the held step."""
        self._check(gen)
        with self._hold:
            self._hold_below = self.steps_done
            return {"steps_done": self.steps_done,
                    "reduced": self.pending is not None and self._reduced_step >= self.pending}

    @fans_out(merge_hold)
    @lane("ckpt")
    def ckpt_advance(self, gen: int, to: int, timeout_s: float) -> dict[str, Any]:
        """Under a hold: lets the steps before ``to`` be applied, and waits (bounded) until
        they are: every replica then holds step ``to``'s state. Returns ``steps_done``."""
        self._check(gen)
        end = time.monotonic() + timeout_s
        with self._hold:
            self._hold_below = to
            self._hold.notify_all()
            while self.steps_done < to and time.monotonic() < end:
                if self._aborted_gen >= self.gen:
                    break
                self._hold.wait(0.02)
            return {"steps_done": self.steps_done, "reduced": True}

    @fans_out()
    @lane("ckpt")
    def ckpt_release(self, gen: int) -> None:
        """Ends a hold: the training thread applies its steps again."""
        with self._hold:
            self._hold_below = None
            self._hold.notify_all()

    @fans_out(merge_ckpt_start)
    @lane("ckpt")
    def ckpt_start_beside(
        self, gen: int, step: int, index: int, num_shards: int, save_id: str, root: str,
        storage_options: Mapping[str, Any] | None = None, *, fsync: bool = True,
        attempts: int = 3, staging_budget_bytes: int | None = None, direct_io: bool = True,
        describe: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """As :meth:`ckpt_start`, but beside the steps, under a hold (:meth:`ckpt_freeze`):
        the committed state of step ``step`` is snapshotted while the training thread may be
        computing the next step (its module buffers, in flux, are taken as committed: see
        BufferSync.committed)."""
        self._check(gen)
        self._refuse_if_dirty("be saved")
        with self._state_lock:
            if self._ckpt_writer is not None and self._ckpt_writer.busy:
                return {"busy": True, "stall_s": None, "bytes": 0, "meta": None}
            if self.steps_done != step:
                raise PlanariaError(f"{self.name} cannot snapshot step {step} beside its steps: "
                                    f"it has {self.steps_done} steps done")
            tensors, meta = flatten_state(self.model, self.optimizer, self.scheduler)
            committed = self.buffer_sync.committed()
            if committed:
                tensors = {**tensors, **{f"model/{k}": v for k, v in committed.items()
                                         if f"model/{k}" in tensors}}
            return self._snapshot(step, index, num_shards, save_id, root, storage_options,
                                  fsync, attempts, staging_budget_bytes, direct_io,
                                  describe, (tensors, meta), phase=False)

    def _snapshot(
        self, step: int, index: int, num_shards: int, save_id: str, root: str,
        storage_options: Mapping[str, Any] | None,
        fsync: bool, attempts: int, staging_budget_bytes: int | None, direct_io: bool,
        describe: dict[str, Any] | None, state: tuple[dict[str, torch.Tensor], dict[str, Any]],
        *, phase: bool = True,
    ) -> dict[str, Any]:
        """Copies this worker's share of ``state`` into the writer's staging and starts its
        write (see :meth:`ckpt_start`)."""
        tensors, meta = state
        plan = self._ckpt_plan(tensors, index, num_shards)
        writer = self._writer(root, storage_options, fsync)
        writer.attempts = attempts
        writer.staging_budget_bytes = staging_budget_bytes
        writer.direct = direct_io
        first = index == 0 and self.shard_index == 0
        meta = self._extra_state_get(meta) if first else meta
        description = None
        if describe is not None and first:
            description = {**describe, "meta": {**_jsonable(meta, "meta"), **describe["meta"]}}
        stall = writer.start(step, tensors, plan, save_id=save_id, describe=description)
        if stall is not None:
            self._ckpt_save_id = save_id
        if phase:
            self._set_phase("idle", step)
        return {"stall_s": stall, "bytes": plan.nbytes, "meta": meta if first else None}

    def _ckpt_plan(self, tensors: Mapping[str, torch.Tensor], index: int, num_shards: int
                   ) -> ShardPlan:
        """What this worker writes as writer ``index`` of ``num_shards`` replicas. A sharded
        replica's worker i writes its share of shard i (file ``i * num_shards + index`` of
        ``num_shards * k``), as rows of the whole tensors; the tensors every worker of a
        replica holds whole (Adam's step) are written by shard 0's workers only."""
        specs = {k: (t.shape, t.dtype) for k, t in tensors.items()}
        if self.k == 1:
            return plan_shards(specs, num_shards)[index]
        origins = shard_origins(self.model, self.optimizer)
        if self.shard_index:
            specs = {n: v for n, v in specs.items() if n in origins}
        return plan_row_shards(specs, origins, num_shards,
                               first_index=self.shard_index * num_shards,
                               num_files=num_shards * self.k)[index]

    @fans_out(merge_ckpt_poll)
    def ckpt_poll(self, save_id: str) -> dict[str, Any] | None:
        """The shard record of save ``save_id`` once written (None while writing); raises
        the write's error if it failed. Not fenced by generation: it only reads what this
        worker's writer did, and the controller matches records to the save by ``save_id``."""
        writer = self._ckpt_writer
        if writer is None or self._ckpt_save_id != save_id:
            raise PlanariaError(f"{self.name} is not writing save {save_id}")
        record = writer.poll()
        if record is None:
            return None
        return {"record": record.to_dict(), "write_s": writer.last_write_s}

    @fans_out(merge_ckpt_poll)
    @lane("ckpt")
    def ckpt_wait(self, save_id: str, timeout_s: float) -> dict[str, Any]:
        """Waits, beside the steps (its own concurrency group), until this worker's shard of
        save ``save_id`` is written and read back, and returns its record: the controller
        commits the save the moment the last writer's answer arrives, not at a later step
        boundary. Raises the write's error, or ``TimeoutError`` past ``timeout_s``."""
        writer = self._ckpt_writer
        if writer is None or self._ckpt_save_id != save_id:
            raise PlanariaError(f"{self.name} is not writing save {save_id}")
        record = writer.result(timeout_s)
        return {"record": record.to_dict(), "write_s": writer.last_write_s,
                "written_t": writer.last_written_t}

    def _writer(
        self,
        root: str,
        storage_options: Mapping[str, Any] | None,
        fsync: bool,
    ) -> AsyncShardWriter:
        key = (root, repr(sorted((storage_options or {}).items())), fsync)
        if self._ckpt_writer is None or self._ckpt_writer_key != key:
            if self._ckpt_writer is not None:
                self._ckpt_writer.close(timeout_s=300)
            self._ckpt_writer = AsyncShardWriter(
                root, fsync=fsync, storage_options=storage_options
            )
            self._ckpt_writer_key = key
        return self._ckpt_writer

    @fans_out(merge_probe)
    def ckpt_probe(
        self, root: str, name: str, storage_options: Mapping[str, Any] | None, size: int
    ) -> dict[str, Any]:
        """Reads the file ``name`` the controller wrote under ``root``: ``ok``, or ``error``
        (a root this worker cannot reach, e.g. a local path on another node). Not fenced:
        it reads only."""
        try:
            st = Storage(root, storage_options)
            got = len(st.read_bytes(st.path(name)))
        except Exception as err:
            return {"ok": False, "error": f"{type(err).__name__}: {err}"}
        if got != size:
            return {"ok": False,
                    "error": f"read {got} bytes of {name}, the controller wrote {size}"}
        return {"ok": True}

    # ---- restoring ---------------------------------------------------------------------------

    @fans_out(merge_ckpt_read)
    def ckpt_read(
        self,
        gen: int,
        path: str,
        names: list[str] | None,
        storage_options: Mapping[str, Any] | None = None,
        *,
        strict: bool = True,
    ) -> dict[str, Any]:
        """Phase 1 of a restore: checks the checkpoint at ``path`` fits this replica, then
        reads tensors ``names`` (None: all) into the live tensors, verifying every byte.

        Returns ``ok``; ``mismatch`` (naming the tensors) if the checkpoint's tensors
        differ from the replica's (with ``strict`` nothing is read, else only the tensors
        that match are); ``error`` (naming the file at fault) and ``storage`` when the
        checkpoint is not usable; else ``bytes`` and ``read_s``.
        """
        self._check(gen)
        self._ckpt_staged = None
        self._set_phase("ckpt_read", -1)
        t0 = time.perf_counter()
        try:
            if not self.optimizer.state:  # so that the optimizer state too lands in touched memory
                self._prebuild_optimizer_state()
            live, _ = flatten_state(self.model, self.optimizer, self.scheduler)
            try:
                manifest = read_manifest(path, storage_options=storage_options)
            except Exception as err:
                return _read_failure(err)
            saved = {n: (tuple(t.shape), t.dtype) for n, t in manifest.tensors.items()}
            mine = {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in live.items()}
            # A sharded replica's worker holds rows of the whole tensors: it reads those.
            origins = shard_origins(self.model, self.optimizer) if self.k > 1 else {}
            rows = {n: (first, first + int(live[n].shape[0]))
                    for n, (_, first) in origins.items()}
            mine.update({n: (whole, mine[n][1]) for n, (whole, _) in origins.items()})
            diff = compare_layouts(saved, mine)
            if diff and strict:
                return {"ok": False, "mismatch": "; ".join(diff), "error": "; ".join(diff)}
            if diff:
                names = [n for n in (names if names is not None else saved)
                         if n in mine and mine[n] == saved[n]]
            self._ckpt_live = live
            self.ckpt_dirty = True
            try:
                tensors, meta = self._load_into_live(path, names, live, manifest,
                                                     storage_options, rows)
            except Exception as err:
                return _read_failure(err)
        finally:
            self._set_phase("idle", -1)
        layout = {n: (t.shape, DTYPES[t.dtype]) for n, t in manifest.tensors.items()}
        self._ckpt_staged = (path, tensors, meta, layout)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        out: dict[str, Any] = {"ok": True, "bytes": nbytes, "read_s": time.perf_counter() - t0}
        if diff:
            out["mismatch"] = "; ".join(diff)
        return out

    def _load_into_live(
        self,
        path: str,
        names: list[str] | None,
        live: Mapping[str, torch.Tensor],
        manifest: Manifest,
        storage_options: Mapping[str, Any] | None,
        rows: Mapping[str, tuple[int, int]] | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Reads tensors ``names`` (None: all) into the live ones: host tensors in place, in
        one pass; tensors on a device (GPU) through a bounded host window, a batch at a time
        (:mod:`planaria.checkpoint.device_load`), never a whole host copy of the state.
        ``manifest`` is the checkpoint's, already read: not read again."""
        wanted = list(names) if names is not None else list(manifest.tensors)
        on_device = [n for n in wanted if n in live and live[n].device.type != "cpu"]
        if not on_device:
            return load_checkpoint(path, names=names, storage_options=storage_options,
                                   into=live, on_progress=self._bytes_moved, manifest=manifest,
                                   rows=rows)
        device_names = set(on_device)
        host = [n for n in wanted if n not in device_names]
        tensors: dict[str, torch.Tensor] = {}
        if host:
            tensors, _ = load_checkpoint(path, names=host, storage_options=storage_options,
                                         into=live, on_progress=self._bytes_moved,
                                         manifest=manifest)
        moved, meta = load_to_device(path, on_device, live, storage_options=storage_options,
                                     on_progress=self._bytes_moved, manifest=manifest)
        tensors.update(moved)
        return tensors, meta

    def _bytes_moved(self, n: int) -> None:
        """A chunk was read: the heartbeat's progress moves (see planaria.liveness)."""
        self.progress += 1

    @fans_out(merge_ckpt_apply)
    def ckpt_apply(
        self, gen: int, path: str, owners: dict[str, int] | None = None
    ) -> dict[str, Any]:
        """Phase 2: loads what :meth:`ckpt_read` read. With ``owners`` (tensor name → the rank
        that read it) every tensor is first broadcast from its owner over this generation's
        process group. Returns ``steps_done`` and ``bcast_s``."""
        self._check(gen)
        if self._ckpt_staged is None or self._ckpt_staged[0] != path:
            raise PlanariaError(f"{self.name} has not read {path}")
        _, tensors, meta, layout = self._ckpt_staged
        self._ckpt_staged = None
        t0 = time.perf_counter()
        live = self._ckpt_live or {}
        if owners is not None:
            self._set_phase("ckpt_bcast", -1)
            tensors = self._broadcast(tensors, layout, owners, live)
        bcast_s = time.perf_counter() - t0
        with torch.no_grad():  # model tensors not filled in place (a layout mismatch) are copied
            for name, tensor in tensors.items():
                target = live.get(name)
                if target is None or not name.startswith("model/"):
                    continue
                if target.data_ptr() != tensor.data_ptr():
                    target.copy_(tensor)
        optim = {k: v for k, v in live.items() if k.startswith("optim/")}  # non-strict: kept
        optim.update({k: v for k, v in tensors.items() if not k.startswith("model/")})
        load_state(None, self.optimizer, self.scheduler, optim, meta)
        self._extra_state_set(meta)
        # Samples a work fault made the job skip (planaria.attribution) stay skipped.
        self.skipped_samples = self.skipped_samples | frozenset(
            int(i) for i in meta.get("skipped_samples") or ())
        self._ckpt_live = None
        self.ckpt_dirty = False
        self._drop_pending()
        self.steps_done = int(meta["steps_done"])
        self._set_phase("idle", self.steps_done)
        return {"steps_done": self.steps_done, "bcast_s": bcast_s,
                "checksum": model_checksum(self.model)}

    def _broadcast(
        self,
        mine: dict[str, torch.Tensor],
        layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        owners: Mapping[str, int],
        live: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        comm = self.comm
        assert comm is not None, "restore before join"
        out: dict[str, torch.Tensor] = {}

        def target(name: str) -> torch.Tensor:
            shape, dtype = layout[name]
            t = live.get(name)
            fits = t is not None and tuple(t.shape) == tuple(shape) and t.dtype == dtype
            if t is not None and fits and t.is_contiguous():
                return t
            return torch.empty(shape, dtype=dtype)

        for owner, names in broadcast_units(layout, owners):
            here = owner == comm.rank
            if len(names) == 1:
                name = names[0]
                buf = mine[name].contiguous() if here else target(name)
                comm.broadcast(buf, owner)
                out[name] = buf
                continue
            dtype = layout[names[0]][1]
            sizes = [_numel(layout[n][0]) for n in names]
            if here:
                flat = torch.cat([mine[n].reshape(-1) for n in names])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype)
            comm.broadcast(flat, owner)
            for name, part in zip(names, torch.split(flat, sizes), strict=True):
                if here:
                    out[name] = mine[name]
                else:
                    out[name] = target(name)
                    out[name].copy_(part.view(layout[name][0]))
        return out
