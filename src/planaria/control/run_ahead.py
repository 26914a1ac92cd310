"""The controller's side of the autonomous loop: runs of steps, watched instead of dispatched.

Between two *boundaries* (where the controller must act: a checkpoint or a replica
check due by step count, a chaos event planned for a step, the end of the
steps) the controller starts one run per worker (:meth:`Worker.run
<planaria.worker.actor.Worker.run>`) and waits: its work per step does
not grow with the number of workers. Events that cannot be planned (a
replacement ready to join, a node draining, a checkpoint or chaos event due by
time) end the run early: the controller sets one store key, rank 0 reads it and
the stop rides on the next step's all-reduce, so every rank stops after the same
step. Deaths arrive as Ray's errors on the runs, hangs from heartbeats and
progress.

When a run fails, a collective may have completed on some survivors and not on
others (a rank dying mid-ring). The survivors report how far they got
(:meth:`settle_run`); the furthest one's steps are committed, and the survivors
behind it receive the state in the next generation, like joiners: no step a
survivor completed is lost, and every live replica ends up with the same state.

Steps are recorded (events, losses, metrics) from rank 0's records alone: the
step's loss, sample and metric sums ride on the all-reduce, so its record has the
step's totals. Rank 0 streams them every 0.25 s (once a later step's reduction
shows that every rank applied them: a step is never reported before it is
committed everywhere), and the controller records them while the run goes on
(progress display, Prometheus, event log); the rest come with the run's result.
New steps on the stream also vouch for every rank of the run
(:meth:`Liveness.vouch <planaria.control.liveness.Liveness.vouch>`): while they come, the
controller reads no heartbeat, so its work per step stays O(1).
With a ledger on, each worker also appends what it was served to a store key
before each step's collective, so that the records of a worker that died survive
it; the ledger is written when the run ends.

This is planaria's one step protocol: :meth:`Job.train_step
<planaria.control.job.Job.train_step>` is a run of one step. Runs are one step long
around recoveries (open faults and joins are closed at their first committed
step), for the job's first step (it names the loss's metrics, which later runs sum
on the status: every rank's own sums come back from a run of one) and when a hook
needs every boundary. A hook (a fault campaign's injector) that has a
``next_step(after)`` method names the boundaries it needs instead, so that its
faults land inside runs as they do in production.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from planaria.control.reconcile import reconcile
from planaria.faults.errors import Failure, NonFiniteLoss, Preempted
from planaria.wire import store_keys
from planaria.wire.reports import (
    RunReport,
    Served,
    Settled,
    StepRecord,
    StepTotals,
    read_served_lines,
    read_stream_chunk,
)

if TYPE_CHECKING:
    from planaria.control.boundary import BoundaryPlanner
    from planaria.control.carry_plan import HeldSteps
    from planaria.control.chaos_injection import ChaosInjector
    from planaria.control.commit_log import CommitLog, StepResult
    from planaria.control.departures import Departures
    from planaria.control.liveness import Liveness
    from planaria.control.membership import Membership
    from planaria.control.notices import Notices
    from planaria.control.policy import HangConfig
    from planaria.control.protocols import Gather
    from planaria.observe.events import EventLog

__all__ = ["RunAhead"]

_log = logging.getLogger("planaria.commits")

MAX_SETTLE_ATTEMPTS = 3


class RunAhead:
    """Runs a job's steps in autonomous runs (see the module doc).

    ``planner`` says when something unplanned needs a boundary; ``notices`` reads the
    preemption notices that come meanwhile; ``chaos`` lands the faults planned for a step;
    ``horizon``: the job's step count (the workers load no step past it); ``held``: what
    a failed run's survivors kept of its last step, resumed by the next run
    (:mod:`planaria.control.carry_plan`; None: the whole step is computed again).
    """

    def __init__(
        self, *, membership: Membership, calls: Gather, commit_log: CommitLog,
        planner: BoundaryPlanner, notices: Notices, departures: Departures,
        chaos: ChaosInjector | None, store: Any, liveness: Liveness, log: EventLog,
        hang: HangConfig, horizon: int, held: HeldSteps | None = None,
    ) -> None:
        self.membership = membership
        self.calls = calls
        self.commit_log = commit_log
        self.planner = planner
        self.notices = notices
        self.departures = departures
        self.chaos = chaos
        self.store = store
        self.liveness = liveness
        self.log = log
        self.hang = hang
        self.horizon = horizon
        self.held = held
        self.run_id = 0
        self._stop_sent = False
        self._why: str | None = None
        self._chunks = 0  # stream chunks of the current run read so far
        self._streamed: list[StepResult] = []  # its steps recorded from the stream
        self._ranks: frozenset[str] = frozenset()  # the current run's members
        self._started_t = 0.0  # when the current run's calls went out (wall clock, as events)

    # ---- a run -------------------------------------------------------------------------------

    def run(self, stop: int) -> list[StepResult]:
        """The next steps up to ``stop`` (past the steps done: the boundary the planner
        chose, :meth:`~planaria.control.boundary.BoundaryPlanner.next_boundary`) and
        commits them, or raises the Failure that ended the run (its steps that every
        survivor applied are committed)."""
        log, members_now = self.commit_log, self.membership
        start = log.steps_done
        assert log.plan is not None
        self.run_id += 1
        self._stop_sent, self._why = False, None
        self._chunks, self._streamed = 0, []
        gen, run_id = members_now.gen, self.run_id
        plan = (log.plan.num_samples, log.plan.global_batch_size, log.plan.seed)
        members = list(members_now.members)
        self._ranks = frozenset(h.name for h in members)
        self._started_t = time.time()
        carry = None if self.held is None else self.held.take(start, [h.name for h in members])
        refs = {
            h.name: h.actor.run.remote(
                gen, run_id, start, stop, plan=plan, skipped=log.last_skipped,
                ledger=log.ledger is not None, metric_keys=log.metric_keys or (),
                horizon=self.horizon, carry=None if carry is None else carry.shares[h.name],
            )
            for h in members
        }
        if carry is not None:  # the survivors keep what they finished of it
            self.log.emit("step_resumed", step=start, gen=gen, kept=carry.kept,
                          redone=carry.redone, unstarted=carry.unstarted, total=carry.total)
        if self.chaos is not None:
            self.chaos.during_step(start)
        try:
            results: dict[str, RunReport] = self.calls.gather(
                refs, deadline_s=self.hang.ceiling_s * (stop - start), step=None,
                poll=self._poll,
            )
        except Failure as failure:
            self._reconcile(failure, start, stop, members)
            raise
        finally:
            self._clear(gen, run_id, len(members))
        head = results[members[0].name]
        self.log.emit("run_ahead", gen=gen, start=start, until=stop,
                      steps=head.steps_done - start, ended=head.ended,
                      why=self._why if head.ended == "stop" else None, width=len(members),
                      started_t=self._started_t)
        return self._record(results, members)

    def _poll(self) -> None:
        """While a run goes on: records the steps rank 0 streamed, and ends the run early
        when something unplanned needs a boundary."""
        self._read_stream()
        self.notices.poll()
        if self._stop_sent or self.departures.evacuating:
            return
        why = self.planner.boundary_wanted()
        if why is None:
            return
        self._stop_sent = True
        self._why = why
        _log.debug("run %d ends early: %s", self.run_id, why)
        self.store.set(store_keys.run_stop(self.membership.gen, self.run_id), why)

    def _commit(self, rec: StepTotals) -> StepResult:
        return self.commit_log.record_step(rec, gen=self.membership.gen,
                                           width=self.membership.width)

    def _read_stream(self) -> None:
        store, gen = self.store, self.membership.gen
        try:
            key = store_keys.run_stream(gen, self.run_id)
            if not store.check([key]):
                return
            count = int(store.get(key))
            if count > self._chunks:  # steps every rank reduced: all alive and moving
                self.liveness.vouch(self._ranks)
            while self._chunks < count:
                raw = store.get(store_keys.run_stream(gen, self.run_id, self._chunks))
                self._chunks += 1
                for rec in read_stream_chunk(raw):
                    if rec.step >= self.commit_log.steps_done:
                        self._streamed.append(self._commit(rec))
        except Exception:  # progress only: the run's result brings every record anyway
            _log.debug("could not read run %d's stream", self.run_id, exc_info=True)

    def _clear(self, gen: int, run_id: int, width: int) -> None:
        store = self.store
        try:
            for chunk in range(self._chunks):
                store.delete_key(store_keys.run_stream(gen, run_id, chunk))
            store.delete_key(store_keys.run_stream(gen, run_id))
            store.delete_key(store_keys.run_stop(gen, run_id))
            if self.commit_log.ledger is not None:
                for rank in range(width):
                    store.delete_key(store_keys.run_ledger(gen, run_id, rank))
        except Exception:  # the store is ours; a leftover key costs a few bytes
            _log.debug("could not clear run %d's keys", run_id, exc_info=True)

    # ---- recording ---------------------------------------------------------------------------

    def _record(self, results: dict[str, RunReport], members: list[Any]) -> list[StepResult]:
        """Records a run's steps from rank 0's records (O(1) per step; O(workers) per step
        only with a ledger, whose records come from every rank); the steps streamed
        already are not recorded again (but enter the ledger here)."""
        log, gen = self.commit_log, self.membership.gen
        head = results[members[0].name]
        ledger = log.ledger is not None
        out: list[StepResult] = list(self._streamed)
        steps = list(head.steps)
        if log.metric_keys is None and steps:
            steps[0] = self._name_metrics(steps[0], [results[h.name].steps for h in members])
        for i, rec in enumerate(steps):
            served = ({h.name: results[h.name].steps[i].served for h in members} if ledger
                      else {})
            if not rec.finite:
                # raises NonFiniteLoss: the policy decides
                log.record_nonfinite(rec, served, gen=gen)
            if ledger:
                log.ledger_step(rec.step, served, gen=gen)
            if rec.step >= log.steps_done:
                out.append(self._commit(rec))
        last = out[-1].step if out else log.steps_done
        for h in members:
            self.notices.reported(h.name, results[h.name].preempting, last)
        return out

    def _name_metrics(self, rec: StepRecord, records: list[Sequence[StepRecord]]) -> StepRecord:
        """The job's first run (one step, before the loss's metrics are known): its metrics
        are the sums of every rank's own (each returns its record of a run of one), and
        their names are the ones later runs sum on the status. Returns ``rec`` with them."""
        sums: dict[str, float] = {}
        for recs in records:
            mine = next((r for r in recs if r.step == rec.step), None)
            for k, v in (mine.metric_sums if mine is not None else {}).items():
                sums[k] = sums.get(k, 0.0) + v
        if rec.finite:
            self.commit_log.metric_keys = tuple(sorted(sums))
        return replace(rec, global_metric_sums=sums)

    def _reconcile(self, failure: Failure, start: int, stop: int, members: list[Any]) -> None:
        """After a failed run: commits what the furthest survivor applied, marks the
        survivors behind it for a state transfer, and dates the failure to the first
        step not committed."""
        log, membership = self.commit_log, self.membership
        # Workers leaving on a notice (every holder at once: Departures.evacuating) are
        # alive: they settle like survivors, so that the steps they applied are recorded.
        lost = set() if isinstance(failure, Preempted) else set(failure.workers)
        answers: dict[str, Settled] = {}
        for _ in range(MAX_SETTLE_ATTEMPTS):
            survivors = [h for h in membership.members if h.name not in lost]
            if not survivors:
                break
            # Those whose run a peer's failure ended answered settled (RunFailed).
            known = {h.name: failure.settled[h.name] for h in survivors
                     if h.name in failure.settled}
            ask = {h.name: h.actor.settle_run.remote(membership.gen) for h in survivors
                   if h.name not in known}
            try:
                answers = known | (self.calls.gather(ask, deadline_s=60, step=None)
                                   if ask else {})
                break
            except Failure as again:  # a survivor failed too: it is lost with the others
                lost |= set(again.workers) or {h.name for h in survivors}
                failure.workers = tuple(dict.fromkeys([*failure.workers, *again.workers]))
        gen = membership.gen
        outcome = reconcile(answers, start=start, members=membership.names)
        committed, behind = outcome.committed, list(outcome.behind)
        # What they kept of the step that failed, for the next run; not after a failure in
        # the work itself (a sample or micro-batch that raised): the work-fault policy moves
        # that work as a whole, and a carried share would hand it to a healthy survivor.
        work = getattr(failure, "work", None)
        if self.held is not None:
            kept = answers if work is None or work.micro_batch is None else {}
            self.held.settled(kept, committed)
        served = self._served_from_store(members) if log.ledger is not None else {}
        for rec in outcome.applied:
            if log.ledger is not None:
                log.ledger_step(rec.step, served.get(rec.step) or {}, gen=gen)
            if rec.step >= log.steps_done:
                self._commit(rec)
        log.advance_to(committed)
        log.ledger_served(committed, served.get(committed) or {}, gen=gen)  # the broken attempt
        for name in behind:
            _log.info("%s is a step behind after the failure: it receives the state", name)
        membership.set_holding(behind, False)  # its collective did not complete
        self.log.emit("run_ahead", gen=gen, start=start, until=stop, steps=committed - start,
                      ended="failed", why=failure.kind, width=len(members),
                      committed=committed, behind=behind, started_t=self._started_t)
        failure.step = committed
        if not isinstance(failure, NonFiniteLoss):
            self.log.emit("step_failed", step=committed, gen=gen, kind=failure.kind,
                          workers=list(failure.workers))

    def adopt_saved(self, step: int) -> list[int]:
        """A wave's leavers applied the steps up to ``step`` and a save beside them holds
        them, but they were gone before their run settled (no record reached the
        controller): those steps are committed, in the ledger too (what each rank was
        served is in the store), so that the restore of ``step`` continues a training in
        which every sample was used once. Returns the steps committed."""
        log, gen = self.commit_log, self.membership.gen
        if step <= log.steps_done:
            return []
        served = (self._served_from_store(self.membership.members) if log.ledger is not None
                  else {})
        steps = log.commit_saved(step, served, gen=gen)
        self.log.emit("steps_committed_by_save", steps=steps, step=step, gen=gen,
                      reason="the leavers applied them before they were gone; the save beside "
                      "them holds them")
        return steps

    def _served_from_store(self, members: list[Any]) -> dict[int, dict[str, Served]]:
        """{step: {worker: served}} from the ledger keys the run's workers appended to."""
        out: dict[int, dict[str, Served]] = {}
        for rank in range(len(members)):
            key = store_keys.run_ledger(self.membership.gen, self.run_id, rank)
            try:
                if not self.store.check([key]):
                    continue
                raw = self.store.get(key).decode()
            except Exception:
                _log.warning("could not read %s: its ledger records are lost", key)
                continue
            for step, worker, served in read_served_lines(raw):
                out.setdefault(step, {})[worker] = served
        return out
