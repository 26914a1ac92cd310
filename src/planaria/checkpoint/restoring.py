"""A restore in a running job: the newest viable checkpoint of the run's lineage, loaded into
every member of the current generation.

Checkpoints are tried newest first (:mod:`planaria.checkpoint.newest`); one that does
not load (its bytes do not verify, a file is missing, the storage keeps failing) is
skipped with a warning naming the file, and the next older one is used. Two ways to get
the state into N replicas (``restore_strategy``):

- ``read_all``: every replica reads (and verifies) the whole checkpoint;
- ``share``: every replica reads 1/N of the tensors (byte-balanced) and the
  rest arrives over the process group (gloo broadcast).

Measured with ``python bench/checkpoint.py --repeat 2`` (3 replicas on the 2-core
CPU box, 208 MB of state, local disk, the machine shared with other jobs, load
average ~10): restoring into 3 replicas took 0.43 s with ``read_all`` against
0.54 s with ``share`` (page cache dropped), and 0.30 s against 0.45 s (warm); a
second run under heavier load gave 0.34 s / 0.43 s cold and 0.43 s / 0.32 s
warm. Local reads with hardware CRC-32C run near memory speed while the gloo
broadcast over loopback TCP adds a second pass over every byte, so ``auto``
picks ``read_all`` on a file system when every replica is on one node. Replicas
on several nodes can only share a root on a shared file system, where
``read_all`` would read every byte N times from one server: ``auto`` picks
``share`` there. On object stores every replica reading everything multiplies
the egress and a remote read is slower than the replicas' interconnect, so
``auto`` picks ``share`` there too (not measured against a remote store: the
tests' S3 server is on loopback).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

from planaria.backoff import retry
from planaria.checkpoint.compat import compare_data_plans
from planaria.checkpoint.dtypes import DTYPES
from planaria.checkpoint.errors import CheckpointError, CheckpointMismatch, NoViableCheckpoint
from planaria.checkpoint.host import CheckpointHost
from planaria.checkpoint.manifest import Manifest
from planaria.checkpoint.newest import LineageCheckpoints, NotViable
from planaria.checkpoint.plan import plan_shards
from planaria.checkpoint.restore import CheckpointInfo, read_manifest
from planaria.checkpoint.root import CheckpointRoot
from planaria.data.ledger import Ledger
from planaria.faults.errors import StorageError
from planaria.wire.state_reports import RestoreRead

__all__ = ["Restore", "RestorePath"]

_log = logging.getLogger("planaria.checkpoint")


class _ReadFailed(Exception):
    """A restore's read hit storage errors (the message names them): tried again."""


@dataclass(frozen=True, kw_only=True)
class Restore:
    """A restore that happened: the checkpoint's step and path, and its ``restore`` event."""

    step: int
    path: str
    record: dict[str, Any]


class RestorePath:
    """Restores ``host``'s members from ``root``'s checkpoints of the run's lineage."""

    def __init__(self, root: CheckpointRoot, host: CheckpointHost) -> None:
        self.root = root
        self.config = root.config
        self.host = host

    def strategy(self) -> str:
        """auto: on a file system, every replica reads everything when all are on one node
        (local reads beat a broadcast), and replicas on several nodes (a shared file
        system: one server) read one share each and broadcast; on object stores always a
        share each (every replica reading everything multiplies egress). A non-strict
        restore reads everything (each replica skips what does not fit)."""
        if not self.config.strict or self.host.config.workers_per_replica > 1:
            return "read_all"  # a sharded replica's workers each read their own shards
        if self.config.restore_strategy != "auto":
            return self.config.restore_strategy
        if not self.root.local:
            return "share"
        nodes = {h.node for h in self.host.members}
        return "read_all" if len(nodes) <= 1 else "share"

    def lost_steps_base(self, reason: str) -> int:
        """The step the job stood at before the restore, for ``lost_steps``: its own, or on
        resume the steps a previous run of this run directory committed (from its ledger;
        0 without one)."""
        host = self.host
        if reason != "resume":
            return host.steps_done
        if host.ledger is None:
            return 0
        try:
            steps = {**Ledger.committed(host.run_dir), **Ledger.skipped(host.run_dir)}
        except (OSError, ValueError, KeyError):
            return 0
        return max(steps) + 1 if steps else 0

    def restore(self, candidates: LineageCheckpoints, *, t0: float, before: int,
                reason: str) -> Restore:
        """Loads the newest viable of ``candidates`` into every member and sets the job's
        step from it; logs ``restore`` (``before``: the step the job stood at).
        :class:`NoViableCheckpoint` if none loads, :class:`CheckpointMismatch` if one does not
        fit the job."""
        host = self.host
        found, warnings = candidates.first_viable(self._attempt)
        if found is None:
            raise NoViableCheckpoint(
                f"none of the {len(candidates.candidates)} committed checkpoints of this run's "
                f"lineage under {self.root.root} could be restored: " + "; ".join(warnings)
            )
        c, (manifest, strategy) = found
        for w in warnings:
            _log.warning("checkpoint %s", w)
        for h in host.members:
            h.has_state = True
        meta = manifest.meta
        host.steps_done = manifest.step
        host.skipped_samples.update(int(i) for i in meta.get("skipped_samples") or ())
        if reason == "resume" and isinstance(meta.get("deadline"), dict):
            host.deadline.load_state_dict(meta["deadline"])
        record = host.log.emit(
            "restore", step=manifest.step, path=c.path, restore_s=time.time() - t0,
            lost_steps=max(0, before - manifest.step), reason=reason, strategy=strategy,
            width=host.width, bytes=manifest.nbytes, skipped=warnings,
        )
        _log.info("restored step %d from %s (%s, %d replicas)", manifest.step, c.path,
                  strategy, host.width)
        return Restore(step=manifest.step, path=c.path, record=record)

    def _attempt(self, c: CheckpointInfo) -> tuple[Manifest, str]:
        """Loads ``c`` into every member: its manifest and the strategy used, or
        :class:`NotViable` saying what was wrong."""
        try:
            manifest = self.root.call(
                functools.partial(read_manifest, c.path, storage_options=self.root.options),
                f"reading the manifest of {c.path}")
        except (CheckpointError, StorageError) as err:
            raise NotViable(str(err)) from err
        self._check_data_plan(c.path, manifest.meta)
        strategy = self.strategy()
        problems = self._load(c.path, manifest, strategy)
        if problems:
            raise NotViable(problems)
        return manifest, strategy

    def _load(self, path: str, manifest: Manifest, strategy: str) -> str | None:
        """Loads the checkpoint into every member; returns what was wrong, or None. A storage
        error is retried (with backoff) before the checkpoint counts as not viable; a
        checkpoint that does not fit the job raises :class:`CheckpointMismatch`."""
        host = self.host
        members = host.members
        owners: dict[str, int] | None = None
        names: list[list[str] | None] = [None] * len(members)
        if strategy == "share" and len(members) > 1:
            specs = {n: (t.shape, DTYPES[t.dtype]) for n, t in manifest.tensors.items()}
            plans = plan_shards(specs, len(members), split_bytes=1 << 62)  # whole tensors
            owners = {s.name: p.index for p in plans for s in p.slices}
            names = [[s.name for s in p.slices] for p in plans]
        deadline = self.root.deadline(manifest.nbytes)

        def read() -> str | None:  # what was wrong, or None; raises _ReadFailed to retry
            refs = {h.name: h.actor.ckpt_read.remote(host.gen, path, names[r],
                                                      self.root.options,
                                                      strict=self.config.strict)
                    for r, h in enumerate(members)}
            host.hook("restore", path=path)
            results: dict[str, RestoreRead] = host.gather(refs, deadline_s=deadline, step=None)
            mismatch = next((r.mismatch for r in results.values() if r.mismatch), None)
            if mismatch and self.config.strict:
                raise CheckpointMismatch(
                    f"{path} does not fit the job: {mismatch}. Restore it into the model it "
                    "was saved from, or set CheckpointConfig(strict=False) to load only the "
                    "tensors that match"
                )
            if mismatch:
                _log.warning("checkpoint %s does not fit the job: %s; loading what matches",
                             path, mismatch)
                host.log.emit("checkpoint_mismatch", path=path, tensors=[mismatch],
                              data_plan=[])
            failed = [r for r in results.values() if r.error is not None]
            storage = [r.error for r in failed if r.error is not None and r.storage]
            problems = [r.error for r in failed if r.error is not None and not r.storage]
            if problems:
                return "; ".join(dict.fromkeys(problems))
            if storage:
                raise _ReadFailed("; ".join(dict.fromkeys(storage)))
            return None

        attempts = self.config.storage_attempts
        try:
            problem = retry(read, what=f"reading {path}", attempts=attempts,
                            retryable=lambda err: isinstance(err, _ReadFailed), log=_log)
        except _ReadFailed as err:
            return f"storage error after {attempts} attempts: {err}"
        if problem is not None:
            return problem
        refs = {h.name: h.actor.ckpt_apply.remote(host.gen, path, owners) for h in members}
        sums: dict[str, int] = host.gather(refs, deadline_s=deadline, step=None)
        if len(set(sums.values())) > 1:
            return f"the replicas' parameters differ after loading it (checksums {sums})"
        return None

    def _check_data_plan(self, path: str, meta: dict[str, Any]) -> None:
        host = self.host
        assert host.plan is not None
        diff = compare_data_plans(meta.get("data_plan"), host.plan.describe())
        if not diff:
            return
        if not self.config.replan_data:
            raise CheckpointMismatch(
                f"{path} was saved with another data plan ({'; '.join(diff)}): resuming would "
                "not see each sample once per epoch; restore it with the same dataset, global "
                "batch size and seed, or set CheckpointConfig(replan_data=True) to plan the "
                "data anew from its step"
            )
        _log.warning("checkpoint %s: data plan differs (%s); planning the data anew",
                     path, "; ".join(diff))
        host.log.emit("checkpoint_mismatch", path=path, data_plan=diff, tensors=[])

    def unmark_members(self) -> None:
        """A restore failed part-way (a worker failed, or no checkpoint loaded): the members'
        live tensors may be half overwritten and none holds usable state now, so the recovery
        restores again (never a resize) or, with nothing to restore, does not go on from them."""
        for h in self.host.members:
            h.has_state = False

