"""The checkpoint coordinator: the controller's side of checkpoints in a running job.

:class:`~planaria.checkpoint.config.CheckpointConfig` says where and how often;
:class:`Checkpointer` is what the job calls, at start, at every step boundary and at the
end; the workers' side is :mod:`planaria.worker.ckpt_save` and
:mod:`planaria.worker.ckpt_restore`. It sees the job through the
Protocols of :mod:`planaria.checkpoint.host` and is made of parts: the root and this
run's identity there (:mod:`~planaria.checkpoint.root`, claimed at start by
:mod:`~planaria.checkpoint.claim`), the save pipeline (:mod:`~planaria.checkpoint.saving`,
with :mod:`~planaria.checkpoint.failures` and :mod:`~planaria.checkpoint.reaper`), the
restore path (:mod:`~planaria.checkpoint.restoring`, choosing by
:mod:`~planaria.checkpoint.newest`) and the root's upkeep (retention, the lease:
:mod:`~planaria.checkpoint.upkeep`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

from planaria.checkpoint.claim import claim_root, probe_root
from planaria.checkpoint.config import CheckpointConfig
from planaria.checkpoint.errors import CheckpointError, NoViableCheckpoint
from planaria.checkpoint.host import CheckpointHost
from planaria.checkpoint.interval import CheckpointInterval
from planaria.checkpoint.restoring import RestorePath
from planaria.checkpoint.root import CheckpointRoot
from planaria.checkpoint.saving import SavePipeline
from planaria.checkpoint.upkeep import RootUpkeep
from planaria.faults.errors import Failure, WorkerLost
from planaria.wire.reports import Hold

__all__ = ["Checkpointer", "save_under"]

_log = logging.getLogger("planaria.checkpoint")


def save_under(host: CheckpointHost, root: str, storage_options: dict[str, Any] | None, *,
               template: CheckpointConfig | None = None,
               lineage: tuple[str, tuple[str | None, ...]] | None = None,
               reason: str = "manual") -> str:
    """Saves ``host``'s committed state under ``root`` with a checkpointer of its own
    (``template``'s settings, no interval, no retention), as run ``lineage[0]`` with that
    lineage (None: a new run id); takes and releases the root's lease; returns the
    committed checkpoint's path (:class:`CheckpointError` if it does not commit)."""
    config = dataclasses.replace(template or CheckpointConfig(), root=root, every=None,
                                 keep_last=None, resume=False,
                                 storage_options=dict(storage_options or {}))
    saver = Checkpointer(host, config, run_id=None if lineage is None else lineage[0])
    if lineage is not None:
        saver.place.lineage = lineage[1]
    place = saver.place
    try:
        place.call(place.lease.acquire, f"taking the lease on {place.root}")
        place.lease.set_lineage(place.lineage)
        place.lease.start_heartbeat()
        probe_root(place, host.members)
        return saver.save_committed(reason)
    finally:
        saver.close()


def _interval(config: CheckpointConfig) -> CheckpointInterval | None:
    if config.every is None:
        return None
    auto = str(config.every).strip().lower() == "auto"
    options: dict[str, Any] = dict(
        mtbf_prior_s=config.mtbf_prior_s, stall_prior_s=config.stall_prior_s,
        max_steps=config.auto_max_steps,
    ) if auto else {}
    if auto:
        options["continuous"] = config.continuous
    return CheckpointInterval.from_spec(config.every, **options)


class Checkpointer:
    """The controller's side of checkpoints for one job (``host``), as run ``run_id``
    (None: a fresh one). ``place``: the root, this run's identity there and its lease."""

    def __init__(self, host: CheckpointHost, config: CheckpointConfig, *,
                 run_id: str | None = None) -> None:
        self.host = host
        self.config = config
        self.place = CheckpointRoot(config, host.run_dir, run_id=run_id)
        self.interval = _interval(config)
        self.upkeep = RootUpkeep(self.place, host.log)
        self.saves = SavePipeline(self.place, host, self.interval, self.upkeep)
        self.restorer = RestorePath(self.place, host)
        self.restores: list[dict[str, Any]] = []
        self._seen_failures = 0
        self._last_boundary: tuple[int, float] | None = None
        self._announced: int | None = None

    # ---- what the job reads ------------------------------------------------------------------

    @property
    def root(self) -> str:
        """The checkpoint root (absolute unless a URL)."""
        return self.place.root

    @property
    def run_id(self) -> str:
        """This run's id, in the markers of the checkpoints it commits."""
        return self.place.run_id

    @property
    def lineage(self) -> tuple[str | None, ...]:
        """Runs whose checkpoints this one continues (oldest first, this run last)."""
        return self.place.lineage

    @property
    def can_save(self) -> bool:
        """Saves are configured (``every`` set)."""
        return self.interval is not None

    @property
    def last_committed(self) -> int | None:
        """The newest step committed (or restored) by this job."""
        return self.saves.last_committed

    @property
    def last_path(self) -> str | None:
        """The checkpoint of :attr:`last_committed`."""
        return self.saves.last_path

    @property
    def inflight_step(self) -> int | None:
        """The step of the save in flight, if any."""
        return None if self.saves.inflight is None else self.saves.inflight.step

    # ---- start ---------------------------------------------------------------------------------

    def on_start(self) -> None:
        """Before generation 0: takes the lease on the root, settles this run's lineage
        (refusing another run's checkpoints unless told what to do with them), removes
        leftovers of crashed saves; announces the interval."""
        claim_root(self.place, self.host.members, self.host.log)
        self._announce(force=True)

    def resume_if_asked(self) -> None:
        """After generation 0: continues from the newest viable checkpoint of the lineage if
        ``resume``; :class:`NoViableCheckpoint` if there are some and none is viable."""
        try:
            if self.config.resume and self.place.candidates().candidates:
                self.restore(reason="resume")
        except BaseException:  # the job does not start: the root is free again
            with contextlib.suppress(Exception):
                self.place.lease.release()
            raise

    # ---- at every boundary ---------------------------------------------------------------------

    def maybe_save(self) -> None:
        """At every step boundary: collects the running save's shards (never waiting), then
        starts a save if one is due."""
        host, saves = self.host, self.saves
        now = time.monotonic()
        self._observe(now)
        saves.progress(block_s=0.0)
        saves.failures.raise_if_failing()
        self.upkeep.keep_lease()
        if self.interval is None or not host.members:
            return
        step = host.steps_done
        if step == saves.last_committed or not self.interval.should_save(step, now):
            return
        if saves.inflight is not None:
            if self.config.if_busy == "skip" or self.interval.continuous:
                _log.info("checkpoint of step %d skipped: the save of step %d is still running",
                          step, saves.inflight.step)
                return
            saves.finish(owed=True)  # training was blocked: stall of the next save
        saves.start(reason="interval")
        self.interval.mark_saved(step, now)
        self._announce()

    def raise_if_failing(self) -> None:
        """Raises the CheckpointError of ``on_failing="stop"`` once saves failed too often."""
        self.saves.failures.raise_if_failing()

    def next_due_step(self) -> int | None:
        """The step count at which the next save falls due by step count (None: by time)."""
        if self.interval is None:
            return None
        return self.interval.next_due_step(self.host.steps_done)

    def due_by_time(self) -> bool:
        """A save decided by time is due now: a run of steps should end at a boundary."""
        return self.interval is not None and self.interval.due_by_time(time.monotonic())

    def _observe(self, now: float) -> None:
        if self.interval is None:
            return
        host = self.host
        failures = host.recovery.failures + host.recovery.preemptions
        for _ in range(failures - self._seen_failures):
            self.interval.observe_failure()
        self._seen_failures = failures
        if self._last_boundary is not None:
            steps, t = self._last_boundary
            if host.steps_done > steps:  # one step, or a run of them
                self.interval.observe_step_time(now - t, host.steps_done - steps)
        self._last_boundary = (host.steps_done, now)

    def _announce(self, *, force: bool = False) -> None:
        """Logs ``checkpoint_interval`` when the interval is set or moves by 10% or more."""
        if self.interval is None:
            return
        every = self.interval.steps()
        last = self._announced
        moved = every is not None and (last is None or abs(every - last) >= max(1, 0.1 * last))
        if force or moved:
            self._announced = every
            self.host.log.emit("checkpoint_interval", **self.interval.describe())

    # ---- saves the job asks for ----------------------------------------------------------------

    def save_now(self, reason: str) -> str | None:
        """Saves the current committed state and waits until it is committed (just in time,
        before a preemption or after a user-code error). Returns its path, or None."""
        if self.interval is None or (not self.config.save_on_preemption and reason == "preemption"):
            return None
        saves = self.saves
        saves.finish(owed=True)
        if self.host.steps_done == saves.last_committed:
            return saves.last_path
        saves.start(reason=reason)
        saves.finish()
        return saves.last_path if saves.last_committed == self.host.steps_done else None

    def save_final(self) -> str | None:
        """At the end of ``fit``: saves the final state (if ``every`` is set) and waits.
        :class:`CheckpointError` if that save does not commit: a run whose end state is
        not saved did not finish."""
        path = self.save_now(reason="final")
        self.upkeep.wait_retention()
        steps_done = self.host.steps_done
        dead = sorted(self.saves.lost_writers & set(self.host.names))
        if path is None and dead:
            # A writer died under it: a worker's loss, which the caller recovers from (the
            # others hold the state) before saving again.
            raise WorkerLost(f"worker {', '.join(dead)} died during the final save",
                             workers=tuple(dead), step=steps_done)
        if path is None and self.interval is not None:
            raise CheckpointError(
                f"the final checkpoint (step {steps_done}) was not committed under "
                f"{self.root}: {self.saves.failures.last or 'unknown reason'}; the newest "
                f"committed one is step {self.last_committed}"
            )
        return path

    def save_committed(self, reason: str = "manual") -> str:
        """Saves the committed state now, whatever the interval, and waits for the commit
        (the job's ``save``); returns its path. :class:`CheckpointError` if it does not
        commit (the job and its state are untouched: try again, or :meth:`save_elsewhere`)."""
        saves = self.saves
        saves.finish()
        if self.host.steps_done != saves.last_committed or saves.last_path is None:
            saves.abandoned.wait(self.config.timeout_s)
            saves.start(reason=reason)
            saves.finish()
        steps_done = self.host.steps_done
        if saves.last_committed != steps_done or saves.last_path is None:
            newest = ("none (nothing committed by this job)" if saves.last_committed is None
                      else f"step {saves.last_committed} ({saves.last_path})")
            raise CheckpointError(
                f"the checkpoint of step {steps_done} was not committed under "
                f"{self.root}: {saves.failures.last or 'unknown reason'}; the newest "
                f"committed one is {newest}"
            )
        return saves.last_path

    def save_elsewhere(self, root: str, storage_options: dict[str, Any] | None = None,
                       *, reason: str = "manual") -> str:
        """Saves the committed state under another ``root`` (another disk, a bucket), in
        this run's lineage, so that a job given that root resumes from it; takes and
        releases that root's lease; waits for the commit and returns its path."""
        self.saves.abandoned.wait(self.config.timeout_s)  # the writers are free for this save
        return save_under(self.host, root, storage_options, template=self.config,
                          lineage=(self.place.run_id, self.place.lineage), reason=reason)

    def save_beside(self, *, reason: str) -> bool:
        """Saves the committed state now, beside the running steps (every member holds the
        state and is about to go: a preemption wave). Every member is held (it applies no
        further step: ``ckpt_freeze``), those a step behind are let through to the furthest
        one's step, and each snapshots its share there while its training thread may still
        compute; the writes go on in the background and the save commits when the last
        writer finishes. The members stay held (the caller aborts the generation). Returns
        whether a snapshot was started (or a save in flight already holds that step)."""
        host, saves = self.host, self.saves
        gen = host.gen
        answers: dict[str, Hold] = host.gather(
            {h.name: h.actor.ckpt_freeze.remote(gen) for h in host.members},
            deadline_s=30.0, step=None)
        target = max(a.steps_done for a in answers.values())
        behind = [h for h in host.members if answers[h.name].steps_done < target]
        if behind:
            done: dict[str, Hold] = host.gather(
                {h.name: h.actor.ckpt_advance.remote(gen, target, 30.0) for h in behind},
                deadline_s=35.0, step=None)
            if any(d.steps_done != target for d in done.values()):
                _log.warning("could not align the replicas on step %d before they leave", target)
                return False
        save = saves.inflight
        if save is not None and save.step == target:
            return True  # the save in flight holds the step in hand: it finishes
        if save is not None:  # an older save's writes: they finish first (bounded)
            saves.finish_within(min(5.0, self.place.deadline(save.nbytes)))
            if saves.inflight is not None:
                return False
        saves.start(reason=reason, beside=target)
        return saves.inflight is not None

    def finish_inflight(self) -> None:
        """Waits (bounded by its deadline) until the save in flight commits or fails."""
        self.saves.finish()

    def writers_settle(self, names: list[str], timeout_s: float) -> None:
        """Before ``names`` leave (a drain): waits, bounded, until the save in flight has their
        shards, so that a save they wrote is not lost with them."""
        self.saves.writers_settle(names, timeout_s)

    # ---- restoring -----------------------------------------------------------------------------

    def restore(self, *, reason: str = "restore") -> int | None:
        """Loads the newest viable checkpoint of this run's lineage into every member of the
        current generation; sets the job's step. Returns that step, or None if the lineage
        has no committed checkpoint. Raises :class:`NoViableCheckpoint` if it has some and
        none loads (the members then hold no usable state: ``has_state`` is cleared), and
        :class:`CheckpointMismatch` if the newest does not fit the job."""
        t0 = time.time()
        before = self.restorer.lost_steps_base(reason)
        self.saves.settle_inflight("a restore began before the save finished")
        self.upkeep.paused = True  # retention deletes nothing meanwhile
        try:
            self.upkeep.wait_retention()
            candidates = self.place.candidates()
            if not candidates.candidates:
                return None
            done = self.restorer.restore(candidates, t0=t0, before=before, reason=reason)
        except (Failure, NoViableCheckpoint):
            self.restorer.unmark_members()
            raise
        finally:
            self.upkeep.paused = False
        self.saves.last_committed, self.saves.last_path = done.step, done.path
        if self.interval is not None:
            self.interval.mark_saved(done.step, time.monotonic())
        self.restores.append(done.record)
        return done.step

    # ---- the end -------------------------------------------------------------------------------

    def close(self) -> None:
        """At job end: finishes the save in flight while its writers live (bounded by its
        deadline: a written save is never thrown away), reports a save left unfinished
        (``checkpoint_failed``), releases the root's lease, stops the threads."""
        self.saves.close()
        self.upkeep.wait_retention(timeout_s=60.0)
        try:
            self.place.lease.release()
        except Exception as err:  # another controller took it, or the storage is gone
            _log.warning("could not release the lease on %s: %s", self.root, err)
        self.saves.shutdown()
        self.upkeep.shutdown()
