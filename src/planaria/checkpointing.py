"""Checkpoints in a running job: when to save, the replica-parallel asynchronous save, restore.

:class:`CheckpointConfig` says where and how often; :class:`Checkpointer` is the
controller's side (the :class:`~planaria.controller.Job` calls its hooks; the
workers' side is :mod:`planaria.worker_checkpoint`).

A save, at a step boundary: every worker applies the committed steps, then
snapshots its byte-balanced share of the state into reused host buffers (the
only part that stalls training) and writes it from a background thread. At the
next boundaries the controller collects the shards' records without waiting;
once it holds all of them, a controller thread checks the files and writes the
manifest and the commit marker (and applies retention). A save never overlaps
the previous one; a writer that dies or leaves mid-save leaves that checkpoint
uncommitted (``checkpoint_failed``) and the job goes on.

A restore (resume at start, the policy's ``restore`` action, or every replica
lost) tries committed checkpoints newest first; a checkpoint whose bytes do not
verify is skipped with a warning naming the file, and the next older one is
used. Two ways to get the state into N replicas (``restore_strategy``):

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

import contextlib
import dataclasses
import functools
import logging
import os
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from planaria.backoff import retry
from planaria.checkpoint import (
    CheckpointError,
    CheckpointInterval,
    ShardRecord,
    apply_retention,
    clean_leftovers,
    commit_checkpoint,
    list_checkpoints,
    new_save_id,
    plan_shards,
    read_manifest,
)
from planaria.checkpoint.backoff import with_retries
from planaria.checkpoint.compat import compare_data_plans
from planaria.checkpoint.config import CheckpointConfig
from planaria.checkpoint.dtypes import DTYPES
from planaria.checkpoint.errors import (
    CheckpointMismatch,
    NoViableCheckpoint,
    OtherRunCheckpoints,
)
from planaria.checkpoint.finished import commit_finished_saves
from planaria.checkpoint.layout import tmp_dir_name
from planaria.checkpoint.lease import RootLease
from planaria.checkpoint.restore import CheckpointInfo, read_run_id
from planaria.checkpoint.retention import delete_checkpoint, remove_uncommitted_save
from planaria.checkpoint.storage import Storage
from planaria.errors import Failure, StorageError, WorkerLost, root_cause

if TYPE_CHECKING:
    from planaria.controller import Job

__all__ = ["CheckpointConfig", "Checkpointer", "save_under"]

_log = logging.getLogger("planaria.checkpoint")
POLL_S = 0.02  # while a blocking save waits for its writers


class _ReadFailed(Exception):
    """A restore's read hit storage errors (the message names them): tried again."""


def save_under(job: Job, root: str, storage_options: dict[str, Any] | None, *,
               template: CheckpointConfig | None = None,
               lineage: tuple[str, tuple[str | None, ...]] | None = None,
               reason: str = "manual") -> str:
    """Saves ``job``'s committed state under ``root`` with a checkpointer of its own
    (``template``'s settings, no interval, no retention), as run ``lineage[0]`` with that
    lineage (None: a new run id); takes and releases the root's lease; returns the
    committed checkpoint's path (:class:`CheckpointError` if it does not commit)."""
    config = dataclasses.replace(template or CheckpointConfig(), root=root, every=None,
                                 keep_last=None, resume=False,
                                 storage_options=dict(storage_options or {}))
    saver = Checkpointer(job, config)
    if lineage is not None:
        saver.run_id, saver.lineage = lineage
        saver.lease = RootLease(Storage(saver.root, saver.options), saver.run_id,
                                config.lease_ttl_s)
    try:
        saver._storage_call(saver.lease.acquire, f"taking the lease on {saver.root}")
        saver.lease.set_lineage(saver.lineage)
        saver.lease.start_heartbeat()
        saver._probe()
        return saver.save_committed(reason)
    finally:
        saver.close()


@dataclass
class _Save:
    """A save in flight. Its writers' answers arrive on Ray's threads (:meth:`Checkpointer.
    _on_written`): ``lock`` guards ``records``, ``written_t``, ``failed`` and ``commit``."""

    step: int
    save_id: str
    reason: str
    writers: dict[str, Any]  # name -> actor, in shard order
    t0: float
    stall_s: float = 0.0
    wait_s: float = 0.0  # of stall_s, waiting for the previous save to commit
    nbytes: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    records: dict[str, list[ShardRecord]] = field(default_factory=dict)
    """Per writer, its shard records (a sharded replica's: one per worker)."""
    written_t: dict[str, float] = field(default_factory=dict)  # when each writer finished
    polls: dict[str, Any] = field(default_factory=dict)  # name -> outstanding ckpt_poll ref
    waits: dict[str, Any] = field(default_factory=dict)  # name -> its ckpt_wait ref
    failed: str | None = None  # a writer's error: the save cannot commit
    commit: Future[str] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    settled: threading.Event = field(default_factory=threading.Event)
    """Set once the save committed or failed (the main thread's waits wake on it)."""


class Checkpointer:
    """The controller's side of checkpoints for one :class:`~planaria.controller.Job`."""

    def __init__(self, job: Job, config: CheckpointConfig) -> None:
        self.job = job
        self.config = config
        root = config.root or str(Path(job.run_dir) / "checkpoints")
        self.root = os.path.abspath(root) if "://" not in root else root
        self.options = dict(config.storage_options)
        self.run_id = secrets.token_hex(8)
        self.lineage: tuple[str | None, ...] = (self.run_id,)
        """Runs whose checkpoints this one continues (oldest first, this run last)."""
        self.lease = RootLease(Storage(self.root, self.options), self.run_id,
                               config.lease_ttl_s)
        self.interval: CheckpointInterval | None = None
        if config.every is not None:
            auto = str(config.every).strip().lower() == "auto"
            options: dict[str, Any] = dict(
                mtbf_prior_s=config.mtbf_prior_s, stall_prior_s=config.stall_prior_s,
                max_steps=config.auto_max_steps,
            ) if auto else {}
            if auto:
                options["continuous"] = config.continuous
            self.interval = CheckpointInterval.from_spec(config.every, **options)
        self.local = Storage(self.root, self.options).local
        self._inflight: _Save | None = None
        self._abandoned: list[tuple[_Save, dict[str, Any]]] = []
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planaria-commit")
        self._retainer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planaria-retain")
        self._retention: Future[list[int]] | None = None
        self._renewal: Future[None] | None = None
        self.last_committed: int | None = None  # newest step committed (or restored) by this job
        self.last_path: str | None = None
        self._seen_failures = 0
        self._last_boundary: tuple[int, float] | None = None
        self._announced: int | None = None
        self._wait_s = 0.0  # training blocked on the save in flight, owed to the next save
        self._restoring = False
        self._last_failure: str | None = None
        self.failed_in_a_row = 0  # saves that did not commit since the last one that did
        self.lost_writers: set[str] = set()  # writers that died under a save
        self._stop_reason: str | None = None
        self.restores: list[dict[str, Any]] = []

    # ---- hooks called by the job -----------------------------------------------------------

    def on_start(self) -> None:
        """Before generation 0: takes the lease on the root, settles this run's lineage
        (refusing another run's checkpoints unless told what to do with them), removes
        leftovers of crashed saves; announces the interval."""
        prev = self._storage_call(self.lease.acquire, "taking the lease on the root")
        try:
            if self.config.resume and prev is not None:
                # Saves the previous controller's writers finished but it did not commit.
                for step in commit_finished_saves(self.root, run_ids=set(prev.lineage),
                                                  storage_options=self.options):
                    self.job.log.emit("checkpoint_adopted", step=step, root=self.root)
            removed = clean_leftovers(self.root, storage_options=self.options)
            if removed:
                _log.info("removed leftovers of unfinished saves: %s", removed)
            committed = self._committed()
            runs = {c.step: self._run_of(c) for c in committed}
            mode = "resume"
            if self.config.resume:
                parent = prev.lineage if prev is not None else tuple(dict.fromkeys(runs.values()))
            else:
                parent, mode = (), self.config.on_other_run
                if committed and mode == "refuse":
                    raise OtherRunCheckpoints(self._other_runs_message(committed, runs))
                if committed and mode == "overwrite":
                    st = Storage(self.root, self.options)
                    for c in committed:
                        delete_checkpoint(st, c)
            self.lineage = (*(r for r in parent if r != self.run_id), self.run_id)
            self.lease.set_lineage(self.lineage)
            self.lease.start_heartbeat()  # stopped by release
            self._probe()
        except BaseException:
            with contextlib.suppress(Exception):
                self.lease.release()
            raise
        self.job.log.emit("checkpoint_lineage", run_id=self.run_id, lineage=list(self.lineage),
                          mode=mode, root=self.root,
                          other_runs=sorted({str(r) for r in runs.values()} - set(map(str, parent)))
                          if mode == "branch" else [])
        self._announce(force=True)

    def _probe(self) -> None:
        """Checks that every worker reads what the controller writes under the root (a local
        path is not shared between nodes); :class:`CheckpointError` naming those that do not."""
        st = Storage(self.root, self.options)
        name = f"PROBE-{self.run_id}"
        data = secrets.token_bytes(64)
        self._storage_call(functools.partial(st.write_bytes, st.path(name), data),
                           "writing the start-up probe")
        try:
            refs = {h.name: h.actor.ckpt_probe.remote(self.root, name, self.options, len(data))
                    for h in self.job.members}
            results = dict(zip(refs, ray.get(list(refs.values()), timeout=self.config.timeout_s),
                               strict=True))
        finally:
            with contextlib.suppress(OSError):
                st.remove(st.path(name))
        bad = {n: r["error"] for n, r in results.items() if not r["ok"]}
        if bad:
            raise CheckpointError(
                f"checkpoint root {self.root} is not readable from every worker ("
                + "; ".join(f"{n}: {e}" for n, e in sorted(bad.items()))
                + "): use storage every node reaches (a shared file system, s3://, gs://)"
            )

    def _other_runs_message(self, committed: list[CheckpointInfo],
                            runs: dict[int, str | None]) -> str:
        by_run: dict[str, list[int]] = {}
        for c in committed:
            by_run.setdefault(str(runs[c.step] or "unnamed (older planaria)"), []).append(c.step)
        held = "; ".join(f"run {r}: steps {', '.join(map(str, s[-5:]))}"
                         + (f" and {len(s) - 5} older" if len(s) > 5 else "")
                         for r, s in by_run.items())
        return (
            f"checkpoint root {self.root} holds {len(committed)} checkpoints of other runs "
            f"({held}) and this run does not resume (--no-resume): resume them (drop "
            "--no-resume), delete them (CheckpointConfig(on_other_run='overwrite'), "
            "--checkpoint-on-other-run overwrite) or keep them and start a separate lineage "
            "beside them (on_other_run='branch'); or give this run another root"
        )

    def resume_if_asked(self) -> None:
        """After generation 0: continues from the newest viable checkpoint of the lineage if
        ``resume``; :class:`NoViableCheckpoint` if there are some and none is viable."""
        try:
            if self.config.resume and self._restore_candidates():
                self.restore(reason="resume")
        except BaseException:  # the job does not start: the root is free again
            with contextlib.suppress(Exception):
                self.lease.release()
            raise

    def maybe_save(self) -> None:
        """At every step boundary: collects the running save's shards (never waiting), then
        starts a save if one is due."""
        job = self.job
        now = time.monotonic()
        self._observe(now)
        self._progress(block_s=0.0)
        self.raise_if_failing()
        self._keep_lease()
        if self.interval is None or not job.members:
            return
        step = job.steps_done
        if step == self.last_committed or not self.interval.should_save(step, now):
            return
        if self._inflight is not None:
            if self.config.if_busy == "skip" or self.interval.continuous:
                _log.info("checkpoint of step %d skipped: the save of step %d is still running",
                          step, self._inflight.step)
                return
            t0 = time.monotonic()
            self._finish(self._deadline(self._inflight.nbytes))
            self._wait_s += time.monotonic() - t0  # training was blocked: stall of the next save
        self._start(reason="interval")
        self.interval.mark_saved(step, now)
        self._announce()

    def next_due_step(self) -> int | None:
        """The step count at which the next save falls due by step count (None: by time)."""
        if self.interval is None:
            return None
        return self.interval.next_due_step(self.job.steps_done)

    def due_by_time(self) -> bool:
        """A save decided by time is due now: a run of steps should end at a boundary."""
        return self.interval is not None and self.interval.due_by_time(time.monotonic())

    def save_now(self, reason: str) -> str | None:
        """Saves the current committed state and waits until it is committed (just in time,
        before a preemption or after a user-code error). Returns its path, or None."""
        if self.interval is None or (not self.config.save_on_preemption and reason == "preemption"):
            return None
        t0 = time.monotonic()
        self._finish(self._deadline(self._inflight.nbytes if self._inflight else 0))
        self._wait_s += time.monotonic() - t0
        if self.job.steps_done == self.last_committed:
            return self.last_path
        self._start(reason=reason)
        self._finish(self._deadline(self._inflight.nbytes if self._inflight else 0))
        return self.last_path if self.last_committed == self.job.steps_done else None

    def save_final(self) -> str | None:
        """At the end of ``fit``: saves the final state (if ``every`` is set) and waits.
        :class:`CheckpointError` if that save does not commit: a run whose end state is
        not saved did not finish."""
        path = self.save_now(reason="final")
        self._wait_retention()
        dead = sorted(self.lost_writers & set(self.job.names))
        if path is None and dead:
            # A writer died under it: a worker's loss, which the caller recovers from (the
            # others hold the state) before saving again.
            raise WorkerLost(f"worker {', '.join(dead)} died during the final save",
                             workers=tuple(dead), step=self.job.steps_done)
        if path is None and self.interval is not None:
            raise CheckpointError(
                f"the final checkpoint (step {self.job.steps_done}) was not committed under "
                f"{self.root}: {self._last_failure or 'unknown reason'}; the newest committed "
                f"one is step {self.last_committed}"
            )
        return path

    def save_committed(self, reason: str = "manual") -> str:
        """Saves the committed state now, whatever the interval, and waits for the commit
        (:meth:`planaria.controller.Job.save`); returns its path. :class:`CheckpointError`
        if it does not commit (the job and its state are untouched: try again, or
        :meth:`save_elsewhere`)."""
        self._finish(self._deadline(self._inflight.nbytes if self._inflight else 0))
        if self.job.steps_done != self.last_committed or self.last_path is None:
            self._wait_abandoned(self.config.timeout_s)
            self._start(reason=reason)
            self._finish(self._deadline(self._inflight.nbytes if self._inflight else 0))
        if self.last_committed != self.job.steps_done or self.last_path is None:
            raise CheckpointError(
                f"the checkpoint of step {self.job.steps_done} was not committed under "
                f"{self.root}: {self._last_failure or 'unknown reason'}; the newest committed "
                f"one is {self._newest()}"
            )
        return self.last_path

    def _newest(self) -> str:
        if self.last_committed is None:
            return "none (nothing committed by this job)"
        return f"step {self.last_committed} ({self.last_path})"

    def save_elsewhere(self, root: str, storage_options: dict[str, Any] | None = None,
                       *, reason: str = "manual") -> str:
        """Saves the committed state under another ``root`` (another disk, a bucket), in
        this run's lineage, so that a job given that root resumes from it; takes and
        releases that root's lease; waits for the commit and returns its path."""
        self._wait_abandoned(self.config.timeout_s)  # the writers are free for this save
        return save_under(self.job, root, storage_options, template=self.config,
                          lineage=(self.run_id, self.lineage), reason=reason)

    def restore(self, *, reason: str = "restore") -> int | None:
        """Loads the newest viable checkpoint of this run's lineage into every member of the
        current generation; sets the job's step. Returns that step, or None if the lineage
        has no committed checkpoint. Raises :class:`NoViableCheckpoint` if it has some and
        none loads (the members then hold no usable state: ``has_state`` is cleared), and
        :class:`CheckpointMismatch` if the newest does not fit the job."""
        job = self.job
        t0 = time.time()
        before = job.steps_done if reason != "resume" else self._ledger_steps()
        self._settle_inflight("a restore began before the save finished")
        self._restoring = True  # retention deletes nothing meanwhile
        try:
            return self._restore(t0, before, reason)
        except (Failure, NoViableCheckpoint):
            # A worker failed mid-restore, or no checkpoint loaded: the members' live tensors
            # may be half overwritten. None holds usable state now, so the recovery restores
            # again (never a resize) or, with nothing to restore, does not go on from them.
            for h in job.members:
                h.has_state = False
            raise
        finally:
            self._restoring = False

    def _restore(self, t0: float, before: int, reason: str) -> int | None:
        job = self.job
        self._wait_retention()
        candidates = self._restore_candidates()
        if not candidates:
            return None
        warnings: list[str] = []
        for c in candidates:
            try:
                manifest = self._storage_call(
                    functools.partial(read_manifest, c.path, storage_options=self.options),
                    f"reading the manifest of {c.path}")
            except (CheckpointError, StorageError) as err:
                warnings.append(f"step {c.step} ({c.path}) skipped: {err}")
                continue
            self._check_data_plan(c.path, manifest.meta)
            strategy = self._strategy()
            problems = self._load(c.path, manifest, strategy)
            if problems:
                warnings.append(f"step {c.step} ({c.path}) skipped: {problems}")
                continue
            for w in warnings:
                _log.warning("checkpoint %s", w)
            for h in job.members:
                h.has_state = True
            meta = manifest.meta
            job.steps_done = manifest.step
            job.skipped_samples.update(int(i) for i in meta.get("skipped_samples") or ())
            if reason == "resume" and isinstance(meta.get("deadline"), dict):
                job.deadline.load_state_dict(meta["deadline"])
            self.last_committed, self.last_path = manifest.step, c.path
            if self.interval is not None:
                self.interval.mark_saved(manifest.step, time.monotonic())
            record = job.log.emit(
                "restore", step=manifest.step, path=c.path, restore_s=time.time() - t0,
                lost_steps=max(0, before - manifest.step), reason=reason, strategy=strategy,
                width=job.width, bytes=manifest.nbytes, skipped=warnings,
            )
            self.restores.append(record)
            _log.info("restored step %d from %s (%s, %d replicas)", manifest.step, c.path,
                      strategy, job.width)
            return manifest.step
        raise NoViableCheckpoint(
            f"none of the {len(candidates)} committed checkpoints of this run's lineage under "
            f"{self.root} could be restored: " + "; ".join(warnings)
        )

    def _check_data_plan(self, path: str, meta: dict[str, Any]) -> None:
        job = self.job
        assert job.plan is not None
        diff = compare_data_plans(meta.get("data_plan"), job.plan.describe())
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
        job.log.emit("checkpoint_mismatch", path=path, data_plan=diff, tensors=[])

    def close(self) -> None:
        """At job end: finishes the save in flight while its writers live (bounded by its
        deadline: a written save is never thrown away), reports a save left unfinished
        (``checkpoint_failed``), releases the root's lease, stops the threads."""
        save = self._inflight
        if save is not None:
            try:
                self._finish(self._deadline(save.nbytes))
            except Exception:  # reported by _progress, or the job is going down anyway
                _log.debug("could not finish the save in flight at close", exc_info=True)
        if self._inflight is not None:
            self._abandon(self._inflight, "abandoned: the job closed before it committed")
        if self._abandoned:  # what failed saves left is removed before the job goes
            self._wait_abandoned(min(30.0, self.config.timeout_s))
        with contextlib.suppress(Exception):  # the removals queued behind the commits
            self._committer.submit(lambda: None).result(timeout=30.0)
        self._wait_retention(timeout_s=60.0)
        try:
            self.lease.release()
        except Exception as err:  # another controller took it, or the storage is gone
            _log.warning("could not release the lease on %s: %s", self.root, err)
        self._committer.shutdown(wait=False)
        self._retainer.shutdown(wait=False)

    # ---- lineage, storage ----------------------------------------------------------------------

    def _keep_lease(self) -> None:
        """Renews the root's lease in the background once a third of its time has passed."""
        if time.time() - self.lease.renewed_t <= self.config.lease_ttl_s / 3:
            return
        if self._renewal is not None and not self._renewal.done():
            return
        if self._renewal is not None and self._renewal.exception() is not None:
            _log.warning("could not renew the lease on %s: %s", self.root,
                         self._renewal.exception())
        self.lease.renewed_t = time.time()  # one attempt per third of the lease
        self._renewal = self._retainer.submit(self.lease.renew)

    def _storage_call(self, fn: Any, what: str) -> Any:
        return with_retries(fn, what=what, attempts=self.config.storage_attempts)

    def _committed(self) -> list[CheckpointInfo]:
        infos = self._storage_call(
            functools.partial(list_checkpoints, self.root, storage_options=self.options),
            f"listing {self.root}")
        return [c for c in infos if c.committed]

    def _run_of(self, c: CheckpointInfo) -> str | None:
        """The run that committed ``c``; ``"unreadable"`` when its marker cannot be read,
        after the storage's retries (a transient error must not hide a checkpoint)."""
        try:
            return self._storage_call(
                functools.partial(read_run_id, c.path, storage_options=self.options),
                f"reading the marker of {c.path}")
        except (CheckpointError, StorageError, OSError):
            return "unreadable"

    def _restore_candidates(self) -> list[CheckpointInfo]:
        """This lineage's committed checkpoints, newest first. :class:`NoViableCheckpoint`
        when there are none but some committed checkpoint's marker could not be read: it
        may be this run's, so this is not "none saved yet" (which would start over)."""
        committed = self._committed()
        runs = {c.path: self._run_of(c) for c in committed}
        own = [c for c in reversed(committed) if runs[c.path] in self.lineage]
        unreadable = [c.path for c in committed if runs[c.path] == "unreadable"]
        if not own and unreadable:
            raise NoViableCheckpoint(
                f"the markers of {len(unreadable)} committed checkpoints under {self.root} "
                f"could not be read ({', '.join(unreadable)}): whether they are this run's "
                "is unknown; fix the storage's access and resume"
            )
        return own

    def _deadline(self, nbytes: int) -> float:
        """A save's or a restore's deadline: the base, plus time for its bytes."""
        return self.config.timeout_s + nbytes / self.config.min_bytes_per_s

    # ---- saving ------------------------------------------------------------------------------

    @property
    def can_save(self) -> bool:
        """Saves are configured (``every`` set)."""
        return self.interval is not None

    def save_beside(self, *, reason: str) -> bool:
        """Saves the committed state now, beside the running steps (every member holds the
        state and is about to go: a preemption wave). Every member is held (it applies no
        further step: ``ckpt_freeze``), those a step behind are let through to the furthest
        one's step, and each snapshots its share there while its training thread may still
        compute; the writes go on in the background and the save commits when the last
        writer finishes. The members stay held (the caller aborts the generation). Returns
        whether a snapshot was started (or a save in flight already holds that step)."""
        job = self.job
        gen = job.gen
        answers = job._gather({h.name: h.actor.ckpt_freeze.remote(gen) for h in job.members},
                              deadline_s=30.0, step=None)
        target = max(a["steps_done"] for a in answers.values())
        behind = [h for h in job.members if answers[h.name]["steps_done"] < target]
        if behind:
            done = job._gather({h.name: h.actor.ckpt_advance.remote(gen, target, 30.0)
                                for h in behind}, deadline_s=35.0, step=None)
            if any(d["steps_done"] != target for d in done.values()):
                _log.warning("could not align the replicas on step %d before they leave", target)
                return False
        save = self._inflight
        if save is not None and save.step == target:
            return True  # the save in flight holds the step in hand: it finishes
        if save is not None:  # an older save's writes: they finish first (bounded)
            self._finish(min(5.0, self._deadline(save.nbytes)))
            if self._inflight is not None:
                return False
        self._start(reason=reason, beside=target)
        return self._inflight is not None

    def _start(self, *, reason: str, beside: int | None = None) -> None:
        """Snapshots the state on every member and starts their writes (blocks for the
        snapshot). ``beside``: the step every member holds under a hold (save_beside): the
        snapshot is taken beside the steps, nothing is committed first."""
        job = self.job
        assert self._inflight is None
        step = job.steps_done if beside is None else beside
        waited = time.monotonic()
        self._wait_abandoned(self.config.timeout_s)
        self._wait_s += time.monotonic() - waited
        t0 = time.time()
        if beside is None:
            job.commit_all()  # the update would be applied at the next step anyway: not stall
        t1 = time.time()
        save = _Save(step, new_save_id(), reason, {h.name: h.actor for h in job.members}, t0)
        width = len(save.writers)
        assert job.plan is not None
        ours = dict(  # the controller's part of the manifest's metadata
            steps_done=step,
            data_position=job.plan.position(step),
            data_plan=job.plan.describe(),
            deadline=job.deadline.state_dict(),
            world_size=width,
            workers_per_replica=job.config.workers_per_replica,
            run_id=self.run_id,
            lineage=list(self.lineage),
            skipped_samples=sorted(job.skipped_samples),
        )
        # Writer 0 keeps the save's description beside the shards, before any shard's record:
        # once every record is there, the files alone make a checkpoint (planaria.checkpoint.
        # finished), whoever commits it.
        describe = {"step": step, "save_id": save.save_id, "reason": reason,
                    "shards": width * job.config.workers_per_replica, "run_id": self.run_id,
                    "meta": ours}
        options: dict[str, Any] = dict(
            fsync=self.config.fsync, attempts=self.config.storage_attempts,
            staging_budget_bytes=self.config.staging_budget_bytes,
            direct_io=self.config.direct_io)
        if beside is None:
            refs = {h.name: h.actor.ckpt_start.remote(
                job.gen, step, i, width, save.save_id, self.root, self.options,
                describe=describe if i == 0 else None, **options)
                for i, h in enumerate(job.members)}
        else:
            refs = {h.name: h.actor.ckpt_start_beside.remote(
                job.gen, step, i, width, save.save_id, self.root, self.options,
                describe=describe if i == 0 else None, **options)
                for i, h in enumerate(job.members)}
        job.log.emit("checkpoint_started", step=step, save_id=save.save_id, reason=reason,
                     writers=list(save.writers), beside=beside is not None)
        job._hook("save", writers=list(save.writers))
        try:
            results = job._gather(refs, deadline_s=self.config.timeout_s, step=None)
        except Failure as failure:
            self._abandon(save, f"a writer failed during the snapshot: {failure}")
            raise
        save.wait_s, self._wait_s = self._wait_s, 0.0
        save.stall_s = time.time() - t1 + save.wait_s
        save.nbytes = sum(int(r["bytes"]) for r in results.values())
        busy = sorted(n for n, r in results.items() if r.get("busy"))
        if busy:  # never block a worker in an actor call on its writer: this save is dropped
            self._inflight = save
            self._abandon(save, f"writer {', '.join(busy)} still writes an earlier save")
            return
        save.meta = {**results[job.members[0].name]["meta"], **ours}
        if self.interval is not None:
            self.interval.observe_stall(save.stall_s)
        self._inflight = save
        # Every writer's answer, awaited beside the steps: the commit starts the moment the
        # last one arrives (no step boundary needed).
        deadline = self._deadline(save.nbytes)
        for name, actor in save.writers.items():
            ref = actor.ckpt_wait.remote(save.save_id, deadline)
            save.waits[name] = ref
            ref.future().add_done_callback(functools.partial(self._on_written, save, name))

    def _on_written(self, save: _Save, name: str, fut: Any) -> None:
        """A writer's answer (on a Ray thread): its records, or why it failed. The last one
        starts the commit on the committer thread at once."""
        try:
            out = fut.result()
        except BaseException as err:  # its write failed, or it died before it finished
            cause = root_cause(err)
            if isinstance(err, ray.exceptions.RayActorError):
                self.lost_writers.add(name)  # a death: the caller recovers, then saves again
            text = str(cause).strip().splitlines()
            with save.lock:
                if save.failed is None and save.commit is None:
                    save.failed = (f"writer {name} failed: {type(cause).__name__}: "
                                   f"{text[0] if text else ''}")
                    save.settled.set()
            return
        with save.lock:
            save.records[name] = [ShardRecord.from_dict(r)
                                  for r in out.get("records") or [out["record"]]]
            save.written_t[name] = float(out.get("written_t") or time.time())
            if (len(save.records) == len(save.writers) and save.commit is None
                    and save.failed is None):
                save.commit = self._committer.submit(self._commit_now, save)

    def _commit_now(self, save: _Save) -> str:
        """Commits ``save`` (the committer thread) and reports it; :meth:`_progress` does the
        bookkeeping later, on the main thread."""
        try:
            path = self._commit(save)
        except BaseException:
            save.settled.set()
            raise
        now = time.time()
        save_s = now - save.t0
        self.job.log.emit(
            "checkpoint_saved", t=now, step=save.step, path=path, bytes=save.nbytes,
            stall_s=save.stall_s, wait_s=save.wait_s, save_s=save_s,
            writers=len(save.writers), reason=save.reason, run_id=self.run_id,
            writers_done_t=max(save.written_t.values(), default=None),
        )
        _log.info("checkpoint of step %d committed: %s", save.step, path)
        # Known at once to whoever asks (an ending job names its newest checkpoint); the rest
        # of the bookkeeping is the main thread's (_progress).
        self.last_committed, self.last_path = save.step, path
        save.settled.set()
        return path

    @property
    def inflight_step(self) -> int | None:
        """The step of the save in flight, if any."""
        return None if self._inflight is None else self._inflight.step

    def finish_inflight(self) -> None:
        """Waits (bounded by its deadline) until the save in flight commits or fails."""
        if self._inflight is not None:
            self._finish(self._deadline(self._inflight.nbytes))

    def writers_settle(self, names: list[str], timeout_s: float) -> None:
        """Before ``names`` leave (a drain): waits, bounded, until the save in flight has their
        shards, so that a save they wrote is not lost with them."""
        save = self._inflight
        if save is None:
            return
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with save.lock:
                done = save.failed is not None or all(
                    n in save.records for n in names if n in save.writers)
            if done:
                return
            save.settled.wait(min(0.05, max(0.0, end - time.monotonic())))

    def _progress(self, *, block_s: float) -> None:
        """Advances the save in flight on the main thread: a failed or orphaned save is
        abandoned, a committed one's bookkeeping done (the commit itself needs no boundary:
        see :meth:`_on_written`). Waits up to ``block_s`` for it to settle."""
        self._reap_abandoned()
        self._check_retention()
        save = self._inflight
        if save is None:
            return
        if block_s > 0:
            save.settled.wait(block_s)
        with save.lock:
            failed, commit = save.failed, save.commit
            missing = [n for n in save.writers if n not in save.records]
        if commit is None:
            if failed is not None:
                self._abandon(save, failed)
                return
            live = set(self.job.names)
            gone = [n for n in missing if n not in live]
            if gone:
                self._abandon(save, f"writer {', '.join(gone)} left before its shard was written")
            return
        if not commit.done():
            return
        self._inflight = None
        try:
            path = commit.result()
        except Exception as err:
            self._failed(save, f"commit failed: {type(err).__name__}: {err}")
            return
        self.last_committed, self.last_path = save.step, path
        self.failed_in_a_row = 0
        if self.interval is not None:
            self.interval.observe_save_time(max(save.written_t.values(), default=time.time())
                                            - save.t0)
        self._retain()

    def _commit(self, save: _Save) -> str:
        records = [r for n in save.writers for r in save.records[n]]
        # Fenced: LeaseHeld if another controller took the root. Renewed (a write) only
        # past a third of its time; otherwise checked (a read).
        stale = time.time() - self.lease.renewed_t > self.config.lease_ttl_s / 3
        self._storage_call(self.lease.renew if stale else self.lease.check, "checking the lease")
        return commit_checkpoint(
            self.root, save.step, records, save.meta, world_size=len(records),
            storage_options=self.options, run_id=self.run_id,
        )

    def _finish(self, timeout_s: float) -> None:
        """Waits (bounded) until no save is in flight."""
        end = time.monotonic() + timeout_s
        while self._inflight is not None:
            if time.monotonic() > end:
                self._abandon(self._inflight, f"not committed within {timeout_s:g} s")
                return
            save = self._inflight
            self._progress(block_s=min(0.5, max(0.0, end - time.monotonic())))
            if self._inflight is save and save.commit is not None and not save.commit.done():
                with contextlib.suppress(Exception):  # reported by _progress
                    save.commit.exception(timeout=min(POLL_S, max(0.0, end - time.monotonic())))

    def _abandon(self, save: _Save, why: str) -> None:
        """The save cannot commit: report it; its files are removed once its writers stop."""
        if self._inflight is save:
            self._inflight = None
        self._failed(save, why)
        live = set(self.job.names)
        pending = {n: a for n, a in save.writers.items() if n in live and n not in save.records}
        self._abandoned.append((save, pending))
        self._reap_abandoned()

    def _failed(self, save: _Save, why: str) -> None:
        self._last_failure = f"step {save.step}: {why}"
        _log.warning("checkpoint of step %d not committed: %s", save.step, why)
        self.job.log.emit("checkpoint_failed", step=save.step, error=why, reason=save.reason)
        self.failed_in_a_row += 1
        if self.failed_in_a_row >= self.config.max_failed_saves:
            self._escalate(why)

    def _escalate(self, why: str) -> None:
        """Saves keep failing: the run goes on without durability. Said loudly, and with
        ``on_failing="stop"`` the job stops (at the next boundary, where this is raised)."""
        newest = ("none" if self.last_committed is None
                  else f"step {self.last_committed} ({self.last_path})")
        message = (f"{self.failed_in_a_row} checkpoints in a row were not committed under "
                   f"{self.root} (last: {why}); the newest committed one is {newest}, and "
                   f"the job is at step {self.job.steps_done}: free space or fix the storage "
                   "(a job killed now loses every step since), or give the job another root")
        self.job.log.emit("checkpoints_failing", failed=self.failed_in_a_row,
                          newest_step=self.last_committed, step=self.job.steps_done,
                          error=why, action=self.config.on_failing)
        _log.error("%s", message)
        if self.config.on_failing == "stop":
            self._stop_reason = message

    def raise_if_failing(self) -> None:
        """Raises the CheckpointError of ``on_failing="stop"`` once saves failed too often."""
        reason, self._stop_reason = self._stop_reason, None
        if reason is not None:
            raise CheckpointError(f"{reason} (CheckpointConfig(on_failing='stop'))")

    def _settle_inflight(self, why: str) -> None:
        """Before a restore: a save whose writers all live is finished (bounded by its
        deadline), so that the restore can start from it (a rollback after a non-finite
        step loses the steps since that save, not since the one before); a save that lost
        a writer is abandoned."""
        save = self._inflight
        if save is None:
            return
        if set(save.writers) <= set(self.job.names):
            self._finish(self._deadline(save.nbytes))
            return
        if save.commit is not None:
            with contextlib.suppress(Exception):  # reported by _progress
                save.commit.result(timeout=self.config.timeout_s)
            self._progress(block_s=0.0)
        else:
            self._abandon(save, why)

    def _wait_abandoned(self, timeout_s: float) -> None:
        """Waits (bounded, here rather than in a worker's actor call) until no writer of an
        abandoned save still writes: a new snapshot would find its writer busy."""
        end = time.monotonic() + timeout_s
        self._reap_abandoned()
        while self._abandoned and time.monotonic() < end:
            refs = [save.polls[n] for save, pending in self._abandoned for n in pending
                    if n in save.polls]
            if refs:
                ray.wait(refs, num_returns=1, timeout=min(0.5, max(0.0, end - time.monotonic())))
            time.sleep(POLL_S)  # a poll answers at once while the write goes on
            self._reap_abandoned()

    def _reap_abandoned(self) -> None:
        """Removes an abandoned save's files once none of its writers still writes them (its
        temporary directory on local disk, its prefix under the step on object stores)."""
        keep = []
        for save, pending in self._abandoned:
            live = set(self.job.names)
            for name in [n for n in pending if n not in live]:
                del pending[name]
            for name, actor in list(pending.items()):
                ref = save.polls.get(name) or actor.ckpt_poll.remote(save.save_id)
                save.polls[name] = ref
                done, _ = ray.wait([ref], timeout=0)
                if done:
                    del save.polls[name]
                    try:
                        if ray.get(done[0]) is None:
                            continue  # still writing
                    except Exception:  # it failed or died: it writes no more
                        pass
                    del pending[name]
            if pending:
                keep.append((save, pending))
            elif self.local:
                st = Storage(self.root, self.options)
                tmp = st.path(tmp_dir_name(save.step, save.save_id))
                self._committer.submit(st.remove_tree, tmp)
            else:
                self._committer.submit(remove_uncommitted_save, Storage(self.root, self.options),
                                       save.step, save.save_id)
        self._abandoned = keep

    def _retain(self) -> None:
        """Deletes old checkpoints of this lineage in the background. Every shard was checked
        by its writer as it was written, so nothing is read back; never during a restore,
        and never fewer than two are kept."""
        if self.config.keep_last is None or self._restoring:
            return
        self._check_retention()
        if self._retention is not None:
            return  # the next save retains
        self._retention = self._retainer.submit(
            apply_retention, self.root, keep_last=max(2, self.config.keep_last),
            keep_every=self.config.keep_every, storage_options=self.options,
            verify_newest=False, run_ids=self.lineage,
        )

    def _check_retention(self) -> None:
        """Reports the outcome of a finished retention pass (``retention_failed`` if it failed)."""
        fut = self._retention
        if fut is None or not fut.done():
            return
        self._retention = None
        try:
            deleted = fut.result()
        except Exception as err:
            _log.warning("checkpoint retention failed: %s: %s", type(err).__name__, err)
            self.job.log.emit("retention_failed", error=f"{type(err).__name__}: {err}")
            return
        if deleted:
            _log.info("retention deleted the checkpoints of steps %s", deleted)

    def _wait_retention(self, timeout_s: float | None = None) -> None:
        fut = self._retention
        if fut is None:
            return
        with contextlib.suppress(Exception):  # reported by _check_retention
            fut.exception(timeout=timeout_s or self.config.timeout_s)
        self._check_retention()

    # ---- the interval ------------------------------------------------------------------------

    def _observe(self, now: float) -> None:
        if self.interval is None:
            return
        job = self.job
        failures = job.recovery.failures + job.recovery.preemptions
        for _ in range(failures - self._seen_failures):
            self.interval.observe_failure()
        self._seen_failures = failures
        if self._last_boundary is not None:
            steps, t = self._last_boundary
            if job.steps_done > steps:  # one step, or a run of them (planaria.run_ahead)
                self.interval.observe_step_time(now - t, job.steps_done - steps)
        self._last_boundary = (job.steps_done, now)

    def _announce(self, *, force: bool = False) -> None:
        """Logs ``checkpoint_interval`` when the interval is set or moves by 10% or more."""
        if self.interval is None:
            return
        every = self.interval.steps()
        last = self._announced
        moved = every is not None and (last is None or abs(every - last) >= max(1, 0.1 * last))
        if force or moved:
            self._announced = every
            self.job.log.emit("checkpoint_interval", **self.interval.describe())

    # ---- restoring ---------------------------------------------------------------------------

    def _strategy(self) -> str:
        """auto: on a file system, every replica reads everything when all are on one node
        (local reads beat a broadcast), and replicas on several nodes (a shared file
        system: one server) read one share each and broadcast; on object stores always a
        share each (every replica reading everything multiplies egress). A non-strict
        restore reads everything (each replica skips what does not fit)."""
        if not self.config.strict or self.job.config.workers_per_replica > 1:
            return "read_all"  # a sharded replica's workers each read their own shards
        if self.config.restore_strategy != "auto":
            return self.config.restore_strategy
        if not self.local:
            return "share"
        nodes = {h.info.get("node") for h in self.job.members}
        return "read_all" if len(nodes) <= 1 else "share"

    def _load(self, path: str, manifest: Any, strategy: str) -> str | None:
        """Loads the checkpoint into every member; returns what was wrong, or None. A storage
        error is retried (with backoff) before the checkpoint counts as not viable; a
        checkpoint that does not fit the job raises :class:`CheckpointMismatch`."""
        job = self.job
        members = job.members
        owners: dict[str, int] | None = None
        names: list[list[str] | None] = [None] * len(members)
        if strategy == "share" and len(members) > 1:
            specs = {n: (t.shape, DTYPES[t.dtype]) for n, t in manifest.tensors.items()}
            plans = plan_shards(specs, len(members), split_bytes=1 << 62)  # whole tensors
            owners = {s.name: p.index for p in plans for s in p.slices}
            names = [[s.name for s in p.slices] for p in plans]
        deadline = self._deadline(manifest.nbytes)

        def read() -> str | None:  # what was wrong, or None; raises _ReadFailed to retry
            refs = {h.name: h.actor.ckpt_read.remote(job.gen, path, names[r], self.options,
                                                      strict=self.config.strict)
                    for r, h in enumerate(members)}
            job._hook("restore", path=path)
            results = job._gather(refs, deadline_s=deadline, step=None)
            mismatch = next((r["mismatch"] for r in results.values() if r.get("mismatch")), None)
            if mismatch and self.config.strict:
                raise CheckpointMismatch(
                    f"{path} does not fit the job: {mismatch}. Restore it into the model it "
                    "was saved from, or set CheckpointConfig(strict=False) to load only the "
                    "tensors that match"
                )
            if mismatch:
                _log.warning("checkpoint %s does not fit the job: %s; loading what matches",
                             path, mismatch)
                job.log.emit("checkpoint_mismatch", path=path, tensors=[mismatch], data_plan=[])
            failed = [r for r in results.values() if not r["ok"]]
            storage = [r["error"] for r in failed if r.get("storage")]
            problems = [r["error"] for r in failed if not r.get("storage")]
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
        refs = {h.name: h.actor.ckpt_apply.remote(job.gen, path, owners) for h in members}
        applied = job._gather(refs, deadline_s=deadline, step=None)
        sums = {name: r["checksum"] for name, r in applied.items()}
        if len(set(sums.values())) > 1:
            return f"the replicas' parameters differ after loading it (checksums {sums})"
        return None

    def _ledger_steps(self) -> int:
        """Steps a previous run of this run directory committed (from its ledger), for
        ``lost_steps`` after a whole-job restart; 0 without a ledger."""
        job = self.job
        if job.ledger is None:
            return 0
        from planaria.data_plan import Ledger

        try:
            steps = {**Ledger.committed(job.run_dir), **Ledger.skipped(job.run_dir)}
        except (OSError, ValueError, KeyError):
            return 0
        return max(steps) + 1 if steps else 0
