"""The replica-parallel asynchronous save, the controller's side: snapshot, writes in the
background, commit once every writer's shard is in, and what happens when it cannot.

A save, at a step boundary: every worker applies the committed steps, then snapshots its
byte-balanced share of the state into reused host buffers (the only part that stalls
training) and writes it from a background thread. Each writer's answer arrives on a Ray
thread; the last one starts the commit (the files are checked, the manifest and the
commit marker written) on the committer thread at once. The main thread does the
bookkeeping at the next boundaries (:meth:`SavePipeline.progress`), never waiting. A save
never overlaps the previous one; a writer that dies or leaves mid-save leaves that
checkpoint uncommitted (``checkpoint_failed``) and the job goes on, unless it died after its
shard was written: written is durable (:mod:`planaria.checkpoint.finished`), so its record
beside the shard stands for its answer.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray

from planaria.checkpoint.commit import commit_checkpoint
from planaria.checkpoint.failures import SaveFailures
from planaria.checkpoint.finished import written_records
from planaria.checkpoint.host import CheckpointHost
from planaria.checkpoint.interval import CheckpointInterval
from planaria.checkpoint.layout import new_save_id
from planaria.checkpoint.reaper import POLL_S, AbandonedSaves
from planaria.checkpoint.root import CheckpointRoot
from planaria.checkpoint.storage import Storage
from planaria.checkpoint.upkeep import RootUpkeep
from planaria.checkpoint.writer import ShardRecord, shard_dir
from planaria.faults import points
from planaria.faults.errors import Failure, root_cause
from planaria.wire.state_reports import ShardWritten, Snapshot

__all__ = ["Save", "SavePipeline"]

_log = logging.getLogger("planaria.checkpoint")


class _NotWritten(Exception):
    """A writer died before every shard of its save was written: the save cannot commit."""


@dataclass
class Save:
    """A save in flight. Its writers' answers arrive on Ray's threads (:meth:`SavePipeline.
    on_written`): ``lock`` guards ``records``, ``written_t``, ``dead``, ``failed`` and
    ``commit``."""

    step: int
    save_id: str
    reason: str
    writers: dict[str, Any]  # name -> actor, in shard order
    t0: float
    stall_s: float = 0.0
    wait_s: float = 0.0  # of stall_s, waiting for the previous save to commit
    copy_s: float = 0.0  # the slowest writer's copy into its staging
    blocked_s: float = 0.0  # the training's wait for a copy beside the steps (of stall_s)
    nbytes: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    records: dict[str, list[ShardRecord]] = field(default_factory=dict)
    """Per writer, its shard records (a sharded replica's: one per worker)."""
    written_t: dict[str, float] = field(default_factory=dict)  # when each writer finished
    polls: dict[str, Any] = field(default_factory=dict)  # name -> outstanding ckpt_poll ref
    waits: dict[str, Any] = field(default_factory=dict)  # name -> its ckpt_wait ref
    dead: dict[str, str] = field(default_factory=dict)
    """Writers that died before they answered -> why: their shards may be written all the same."""
    failed: str | None = None  # a writer's error: the save cannot commit
    commit: Future[str] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    settled: threading.Event = field(default_factory=threading.Event)
    """Set once the save committed or failed (the main thread's waits wake on it)."""


class SavePipeline:
    """Saves of ``host``'s committed state under ``root``, one in flight at a time.

    ``last_committed``/``last_path``: the newest step committed (or restored) by this job
    and its checkpoint. ``lost_writers``: writers that died under a save (a death: the
    job recovers, then saves again)."""

    def __init__(self, root: CheckpointRoot, host: CheckpointHost,
                 interval: CheckpointInterval | None, upkeep: RootUpkeep) -> None:
        self.root = root
        self.config = root.config
        self.host = host
        self.interval = interval
        self.upkeep = upkeep
        self.failures = SaveFailures(root.config, root.root, host.log)
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planaria-commit")
        self.abandoned = AbandonedSaves(root, host, self._committer)
        self.inflight: Save | None = None
        self.last_committed: int | None = None
        self.last_path: str | None = None
        self.lost_writers: set[str] = set()
        self.owed_wait_s = 0.0  # training blocked on the save in flight, owed to the next save

    @property
    def newest(self) -> tuple[int, str | None] | None:
        return None if self.last_committed is None else (self.last_committed, self.last_path)

    # ---- starting ----------------------------------------------------------------------------

    def start(self, *, reason: str, beside: int | None = None) -> None:
        """Snapshots the state on every member and starts their writes (blocks for the
        snapshot). ``beside``: the step every member holds under a hold (save_beside): the
        snapshot is taken beside the steps, nothing is committed first."""
        host = self.host
        assert self.inflight is None
        step = host.steps_done if beside is None else beside
        waited = time.monotonic()
        self.abandoned.wait(self.config.timeout_s)
        self.owed_wait_s += time.monotonic() - waited
        t0 = time.time()
        if beside is None:
            host.commit_all()  # the update would be applied at the next step anyway: not stall
        t1 = time.time()
        save = Save(step, new_save_id(), reason, {h.name: h.actor for h in host.members}, t0)
        width = len(save.writers)
        assert host.plan is not None
        ours = dict(  # the controller's part of the manifest's metadata
            steps_done=step,
            data_position=host.plan.position(step),
            data_plan=host.plan.describe(),
            deadline=host.deadline.state_dict(),
            world_size=width,
            workers_per_replica=host.config.workers_per_replica,
            run_id=self.root.run_id,
            lineage=list(self.root.lineage),
            skipped_samples=sorted(host.skipped_samples),
        )
        # Writer 0 keeps the save's description beside the shards, before any shard's record:
        # once every record is there, the files alone make a checkpoint (planaria.checkpoint.
        # finished), whoever commits it.
        describe = {"step": step, "save_id": save.save_id, "reason": reason,
                    "shards": width * host.config.workers_per_replica,
                    "run_id": self.root.run_id, "meta": ours}
        options: dict[str, Any] = dict(
            fsync=self.config.fsync, attempts=self.config.storage_attempts,
            staging_budget_bytes=self.config.staging_budget_bytes,
            direct_io=self.config.direct_io)
        root, opts = self.root.root, self.root.options
        if beside is None:
            refs = {h.name: h.actor.ckpt_start.remote(
                host.gen, step, i, width, save.save_id, root, opts,
                describe=describe if i == 0 else None, copy_beside=self.config.copy_beside,
                **options)
                for i, h in enumerate(host.members)}
        else:
            refs = {h.name: h.actor.ckpt_start_beside.remote(
                host.gen, step, i, width, save.save_id, root, opts,
                describe=describe if i == 0 else None, **options)
                for i, h in enumerate(host.members)}
        host.log.emit("checkpoint_started", step=step, save_id=save.save_id, reason=reason,
                      writers=list(save.writers), beside=beside is not None)
        host.hook("save", writers=list(save.writers))
        try:
            results: dict[str, Snapshot] = host.gather(refs, deadline_s=self.config.timeout_s,
                                                       step=None)
        except Failure as failure:
            self.abandon(save, f"a writer failed during the snapshot: {failure}")
            raise
        save.wait_s, self.owed_wait_s = self.owed_wait_s, 0.0
        save.stall_s = time.time() - t1 + save.wait_s
        save.nbytes = sum(r.nbytes for r in results.values())
        save.copy_s = max((r.copy_s for r in results.values()), default=0.0)
        busy = sorted(n for n, r in results.items() if r.busy)
        if busy:  # never block a worker in an actor call on its writer: this save is dropped
            self.inflight = save
            self.abandon(save, f"writer {', '.join(busy)} still writes an earlier save")
            return
        save.meta = {**(results[host.members[0].name].meta or {}), **ours}
        self.inflight = save
        points.hit("checkpoint.save_started", step=step, reason=reason)
        # Every writer's answer, awaited beside the steps: the commit starts the moment the
        # last one arrives (no step boundary needed).
        deadline = self.root.deadline(save.nbytes)
        for name, actor in save.writers.items():
            ref = actor.ckpt_wait.remote(save.save_id, deadline)
            save.waits[name] = ref
            ref.future().add_done_callback(functools.partial(self.on_written, save, name))

    # ---- committing --------------------------------------------------------------------------

    def on_written(self, save: Save, name: str, fut: Any) -> None:
        """A writer's answer (on a Ray thread): its records, or why it failed. The last one
        starts the commit on the committer thread at once. A fault in this bookkeeping itself
        (a malformed record, a committer shut down) fails the save rather than leaving it
        unsettled until its deadline: no one would hear of an exception on Ray's thread."""
        try:
            self._on_written(save, name, fut)
        except BaseException as err:
            _log.exception("the answer of writer %s to the save of step %d could not be "
                           "handled", name, save.step)
            with save.lock:
                if save.failed is None and save.commit is None:
                    save.failed = (f"writer {name}'s answer could not be handled: "
                                   f"{type(err).__name__}: {err}")
                    save.settled.set()

    def _on_written(self, save: Save, name: str, fut: Any) -> None:
        try:
            out: ShardWritten = fut.result()
        except BaseException as err:  # its write failed, or it died before it finished
            cause = root_cause(err)
            text = str(cause).strip().splitlines()
            why = f"writer {name} failed: {type(cause).__name__}: {text[0] if text else ''}"
            with save.lock:
                if isinstance(err, ray.exceptions.RayActorError):
                    self.lost_writers.add(name)  # a death: the caller recovers, then saves again
                    save.dead[name] = why  # after its shard was written, maybe: see below
                elif save.failed is None and save.commit is None:
                    save.failed = why
                    save.settled.set()
                    return
                self._commit_if_answered(save)
            return
        with save.lock:
            save.records[name] = [ShardRecord.from_dict(r) for r in out.records]
            save.written_t[name] = out.written_t
            save.copy_s = max(save.copy_s, out.copy_s)
            if out.blocked_s > save.blocked_s:  # the slowest replica's wait held the others
                save.stall_s += out.blocked_s - save.blocked_s
                save.blocked_s = out.blocked_s
            self._commit_if_answered(save)

    def _commit_if_answered(self, save: Save) -> None:
        """Once every writer answered (``save.lock`` held): the commit starts, from the
        records beside the shards if a writer died (:meth:`_commit_written`)."""
        if (len(save.records) + len(save.dead) == len(save.writers) and save.commit is None
                and save.failed is None):
            commit = self._commit_written if save.dead else self._commit_now
            save.commit = self._committer.submit(commit, save)

    def _commit_written(self, save: Save) -> str:
        """A writer died before it answered: if every shard of the save was written (its record
        beside it), the save is whole and commits; otherwise :class:`_NotWritten`."""
        why = "; ".join(save.dead.values())
        st = Storage(self.root.root, self.root.options)
        shards = len(save.writers) * self.host.config.workers_per_replica
        try:
            records = written_records(st, shard_dir(st, save.step, save.save_id), shards)
        except (OSError, ValueError, KeyError) as err:
            records, why = None, f"{why}; its records unread: {type(err).__name__}: {err}"
        if records is None:
            save.settled.set()
            raise _NotWritten(why)
        _log.info("the save of step %d was written before %s died: it commits", save.step,
                  ", ".join(save.dead))
        return self._commit_now(save, records)

    def _commit_now(self, save: Save, records: list[ShardRecord] | None = None) -> str:
        """Commits ``save`` (the committer thread; ``records``: its writers' unless given)
        and reports it; :meth:`progress` does the bookkeeping later, on the main thread."""
        try:
            path = self._commit(save, records)
        except BaseException:
            save.settled.set()
            raise
        now = time.time()
        self.host.log.emit(
            "checkpoint_saved", t=now, step=save.step, path=path, bytes=save.nbytes,
            stall_s=save.stall_s, wait_s=save.wait_s, copy_s=save.copy_s,
            blocked_s=save.blocked_s, save_s=now - save.t0,
            writers=len(save.writers), reason=save.reason, run_id=self.root.run_id,
            writers_done_t=max(save.written_t.values(), default=None),
        )
        _log.info("checkpoint of step %d committed: %s", save.step, path)
        # Known at once to whoever asks (an ending job names its newest checkpoint); the rest
        # of the bookkeeping is the main thread's (progress).
        self.last_committed, self.last_path = save.step, path
        save.settled.set()
        return path

    def _commit(self, save: Save, records: list[ShardRecord] | None) -> str:
        if records is None:
            records = [r for n in save.writers for r in save.records[n]]
        # Fenced: LeaseHeld if another controller took the root. Renewed (a write) only
        # past a third of its time; otherwise checked (a read).
        lease = self.root.lease
        stale = time.time() - lease.renewed_t > self.config.lease_ttl_s / 3
        self.root.call(lease.renew if stale else lease.check, "checking the lease")
        points.hit("checkpoint.before_commit", step=save.step)
        path = commit_checkpoint(
            self.root.root, save.step, records, save.meta, world_size=len(records),
            storage_options=self.root.options, run_id=self.root.run_id,
        )
        points.hit("checkpoint.after_commit", step=save.step, path=path)
        return path

    # ---- the save in flight, on the main thread ----------------------------------------------

    def progress(self, *, block_s: float) -> None:
        """Advances the save in flight on the main thread: a failed or orphaned save is
        abandoned, a committed one's bookkeeping done (the commit itself needs no boundary:
        see :meth:`on_written`). Waits up to ``block_s`` for it to settle."""
        self.abandoned.reap()
        self.upkeep.check_retention()
        save = self.inflight
        if save is None:
            return
        if block_s > 0:
            save.settled.wait(block_s)
        with save.lock:
            failed, commit = save.failed, save.commit
            missing = [n for n in save.writers if n not in save.records and n not in save.dead]
        if commit is None:
            if failed is not None:
                self.abandon(save, failed)
                return
            live = set(self.host.names)
            gone = [n for n in missing if n not in live]
            if gone:
                self.abandon(save, f"writer {', '.join(gone)} left before its shard was written")
            return
        if not commit.done():
            return
        self.inflight = None
        try:
            path = commit.result()
        except _NotWritten as err:
            self.abandon(save, str(err))
            return
        except Exception as err:
            self._failed(save, f"commit failed: {type(err).__name__}: {err}")
            return
        self.last_committed, self.last_path = save.step, path
        self.failures.committed()
        if self.interval is not None:  # the stall is whole once every writer's copy ended
            self.interval.observe_stall(save.stall_s)
            self.interval.observe_save_time(max(save.written_t.values(), default=time.time())
                                            - save.t0)
        self.upkeep.retain()

    def finish_within(self, timeout_s: float) -> None:
        """Waits (bounded) until no save is in flight; abandons one still there at the end."""
        end = time.monotonic() + timeout_s
        while self.inflight is not None:
            if time.monotonic() > end:
                self.abandon(self.inflight, f"not committed within {timeout_s:g} s")
                return
            save = self.inflight
            self.progress(block_s=min(0.5, max(0.0, end - time.monotonic())))
            if self.inflight is save and save.commit is not None and not save.commit.done():
                with contextlib.suppress(Exception):  # reported by progress
                    save.commit.exception(timeout=min(POLL_S, max(0.0, end - time.monotonic())))

    def finish(self, *, owed: bool = False) -> None:
        """Waits until the save in flight (if any) commits or fails, bounded by its deadline.
        ``owed``: training is blocked meanwhile, a stall the next save counts."""
        t0 = time.monotonic()
        self.finish_within(self.root.deadline(self.inflight.nbytes if self.inflight else 0))
        if owed:
            self.owed_wait_s += time.monotonic() - t0

    def abandon(self, save: Save, why: str) -> None:
        """The save cannot commit: report it; its files are removed once its writers stop."""
        if self.inflight is save:
            self.inflight = None
        self._failed(save, why)
        live = set(self.host.names)
        pending = {n: a for n, a in save.writers.items() if n in live and n not in save.records}
        self.abandoned.add(save, pending)

    def _failed(self, save: Save, why: str) -> None:
        self.failures.failed(save.step, save.reason, why, steps_done=self.host.steps_done,
                             newest=self.newest)

    def settle_inflight(self, why: str) -> None:
        """Before a restore: a save whose writers all live is finished (bounded by its
        deadline), so that the restore can start from it (a rollback after a non-finite
        step loses the steps since that save, not since the one before), and so is one
        whose lost writers died (their shards may be written); a save that lost a writer
        otherwise is abandoned (``why``)."""
        save = self.inflight
        if save is None:
            return
        with save.lock:
            dead = set(save.dead)
        if set(save.writers) - dead <= set(self.host.names):
            self.finish()
            return
        if save.commit is not None:
            with contextlib.suppress(Exception):  # reported by progress
                save.commit.result(timeout=self.config.timeout_s)
            self.progress(block_s=0.0)
        else:
            self.abandon(save, why)

    def writers_settle(self, names: list[str], timeout_s: float) -> None:
        """Before ``names`` leave (a drain): waits, bounded, until the save in flight has their
        shards, so that a save they wrote is not lost with them."""
        save = self.inflight
        if save is None:
            return
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with save.lock:
                done = save.failed is not None or all(
                    n in save.records or n in save.dead for n in names if n in save.writers)
            if done:
                return
            save.settled.wait(min(0.05, max(0.0, end - time.monotonic())))

    def close(self) -> None:
        """At job end: finishes the save in flight while its writers live (bounded by its
        deadline: a written save is never thrown away), reports a save left unfinished,
        removes what failed saves left (bounded), stops the committer."""
        if self.inflight is not None:
            try:
                self.finish()
            except Exception:  # reported by progress, or the job is going down anyway
                _log.debug("could not finish the save in flight at close", exc_info=True)
        if self.inflight is not None:
            self.abandon(self.inflight, "abandoned: the job closed before it committed")
        if self.abandoned:  # what failed saves left is removed before the job goes
            self.abandoned.wait(min(30.0, self.config.timeout_s))
        with contextlib.suppress(Exception):  # the removals queued behind the commits
            self._committer.submit(lambda: None).result(timeout=30.0)

    def shutdown(self) -> None:
        self._committer.shutdown(wait=False)
