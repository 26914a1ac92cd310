"""The worker's side of a restore: read a checkpoint into the live state, then load it.

Restoring is two-phase: :meth:`CheckpointRestorer.read` reads (and verifies)
tensors straight into the replica's live tensors (memory already allocated and
touched: reading into fresh memory costs more in page faults than the read
itself), :meth:`CheckpointRestorer.apply` then loads the rest (optimizer and
scheduler metadata), after broadcasting each tensor from the replica that read
it when the replicas read shares. Before reading, the checkpoint's tensors
(names, shapes, dtypes) are compared with the replica's: a mismatch is reported
and nothing is read. A read that fails leaves the replica's state partly
overwritten: the replica is *dirty* until a restore completes, and a dirty
replica refuses to step, to send its state and to be saved. Storage errors are
reported as such (the controller retries them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from planaria.checkpoint import CheckpointError, Manifest, load_checkpoint, read_manifest
from planaria.checkpoint.backoff import is_storage_error
from planaria.checkpoint.compat import compare_layouts
from planaria.checkpoint.device_load import load_to_device
from planaria.checkpoint.dtypes import DTYPES, dtype_name
from planaria.faults.errors import PlanariaError
from planaria.wire.state_reports import RestoreRead
from planaria.worker.commit import Commits
from planaria.worker.loader import SampleLoader
from planaria.worker.membership import Membership
from planaria.worker.replica_state import ReplicaState
from planaria.worker.state import load_hooked_model_tensors, load_state, shard_origins
from planaria.worker.vitals import Vitals

__all__ = ["SMALL_TENSOR_BYTES", "CheckpointRestorer", "broadcast_units"]

SMALL_TENSOR_BYTES = 1 << 20  # smaller ones are broadcast coalesced (one buffer per owner, dtype)

Layout = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def broadcast_units(layout: Layout, owners: Mapping[str, int]) -> list[tuple[int, list[str]]]:
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


def _read_failure(err: Exception) -> RestoreRead:
    """What :meth:`CheckpointRestorer.read` reports for an error while reading."""
    if isinstance(err, CheckpointError):
        return RestoreRead(error=str(err))
    if is_storage_error(err):
        return RestoreRead(error=f"{type(err).__name__}: {err}", storage=True)
    raise err


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class CheckpointRestorer:
    """Reads a checkpoint into this replica (:meth:`read`), then loads it (:meth:`apply`)."""

    def __init__(self, name: str, state: ReplicaState, commits: Commits, loader: SampleLoader,
                 membership: Membership, vitals: Vitals) -> None:
        self.name = name
        self.state = state
        self.commits = commits
        self.loader = loader
        self.membership = membership
        self.vitals = vitals
        self.staged: tuple[str, dict[str, torch.Tensor], dict[str, Any], Layout] | None = None
        self.live: dict[str, torch.Tensor] | None = None

    def read(self, path: str, names: list[str] | None,
             storage_options: Mapping[str, Any] | None, *, strict: bool) -> RestoreRead:
        """Phase 1: checks the checkpoint at ``path`` fits this replica, then reads tensors
        ``names`` (None: all) into the live tensors, verifying every byte.

        Reports a ``mismatch`` (naming the tensors) if the checkpoint's tensors differ
        from the replica's (with ``strict`` nothing is read, else only the tensors that
        match are); an ``error`` (naming the file at fault), ``storage`` or not, when the
        checkpoint is not usable.
        """
        state = self.state
        self.staged = None
        self.vitals.set_phase("ckpt_read", -1)
        state.wait_readers()  # the read writes the live tensors: a save's copy ends first
        try:
            if not state.optimizer.state:  # so that the optimizer state too lands in touched memory
                self.commits.prebuild_optimizer_state()
            live, _ = state.flatten()
            try:
                manifest = read_manifest(path, storage_options=storage_options)
            except Exception as err:
                return _read_failure(err)
            saved = {n: (tuple(t.shape), t.dtype) for n, t in manifest.tensors.items()}
            mine = {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in live.items()}
            # A sharded replica's worker holds rows of the whole tensors: it reads those.
            origins = shard_origins(state.model, state.optimizer) if state.shape.k > 1 else {}
            rows = {n: (first, first + int(live[n].shape[0]))
                    for n, (_, first) in origins.items()}
            mine.update({n: (whole, mine[n][1]) for n, (whole, _) in origins.items()})
            diff = compare_layouts(saved, mine)
            if diff and strict:
                return RestoreRead(error="; ".join(diff), mismatch="; ".join(diff))
            if diff:
                names = [n for n in (names if names is not None else saved)
                         if n in mine and mine[n] == saved[n]]
            self.live = live
            state.dirty = True
            try:
                tensors, meta = self._load_into_live(path, names, live, manifest,
                                                     storage_options, rows)
            except Exception as err:
                return _read_failure(err)
        finally:
            self.vitals.set_phase("idle", -1)
        layout = {n: (t.shape, DTYPES[t.dtype]) for n, t in manifest.tensors.items()}
        self.staged = (path, tensors, meta, layout)
        return RestoreRead(mismatch="; ".join(diff) if diff else None)

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
        moved_bytes = self.vitals.bytes_moved
        if not on_device:
            return load_checkpoint(path, names=names, storage_options=storage_options,
                                   into=live, on_progress=moved_bytes, manifest=manifest,
                                   rows=rows)
        device_names = set(on_device)
        host = [n for n in wanted if n not in device_names]
        tensors: dict[str, torch.Tensor] = {}
        if host:
            tensors, _ = load_checkpoint(path, names=host, storage_options=storage_options,
                                         into=live, on_progress=moved_bytes,
                                         manifest=manifest)
        moved, meta = load_to_device(path, on_device, live, storage_options=storage_options,
                                     on_progress=moved_bytes, manifest=manifest)
        tensors.update(moved)
        return tensors, meta

    def apply(self, path: str, owners: dict[str, int] | None) -> int:
        """Phase 2: loads what :meth:`read` read. With ``owners`` (tensor name → the rank
        that read it) every tensor is first broadcast from its owner over this generation's
        process group. Returns the model's checksum."""
        if self.staged is None or self.staged[0] != path:
            raise PlanariaError(f"{self.name} has not read {path}")
        _, tensors, meta, layout = self.staged
        self.staged = None
        state = self.state
        live = self.live or {}
        if owners is not None:
            self.vitals.set_phase("ckpt_bcast", -1)
            tensors = self._broadcast(tensors, layout, owners, live)
        with torch.no_grad():  # model tensors not filled in place (a layout mismatch) are copied
            for name, tensor in tensors.items():
                target = live.get(name)
                if target is None or not name.startswith("model/"):
                    continue
                if target.data_ptr() != tensor.data_ptr():
                    target.copy_(tensor)
            load_hooked_model_tensors(state.model, tensors)
        optim = {k: v for k, v in live.items() if k.startswith("optim/")}  # non-strict: kept
        optim.update({k: v for k, v in tensors.items() if not k.startswith("model/")})
        load_state(None, state.optimizer, state.scheduler, optim, meta)
        state.set_extra_state(meta)
        # Samples a work fault made the job skip (planaria.control.attribution) stay skipped.
        self.loader.skipped_samples = self.loader.skipped_samples | frozenset(
            int(i) for i in meta.get("skipped_samples") or ())
        self.live = None
        state.dirty = False
        self.commits.drop_pending()
        self.commits.steps_done = int(meta["steps_done"])
        self.vitals.set_phase("idle", self.commits.steps_done)
        return state.checksum()

    def _broadcast(
        self,
        mine: dict[str, torch.Tensor],
        layout: Layout,
        owners: Mapping[str, int],
        live: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        comm = self.membership.comm
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
