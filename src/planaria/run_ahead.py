"""The controller's side of the autonomous loop: runs of steps, watched instead of dispatched.

Between two *boundaries* (where the controller must act: a checkpoint or a replica
check due by step count, a chaos event planned for a step, the end of the
steps) the controller starts one run per worker (:meth:`Worker.run
<planaria.worker_loop.WorkerLoopMixin.run>`) and waits: its work per step does
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
(:meth:`Liveness.vouch <planaria.liveness.Liveness.vouch>`): while they come, the
controller reads no heartbeat, so its work per step stays O(1).
With a ledger on, each worker also appends what it was served to a store key
before each step's collective, so that the records of a worker that died survive
it; the ledger is written when the run ends.

This is planaria's one step protocol: :meth:`Job.train_step
<planaria.controller.Job.train_step>` is a run of one step. Runs are one step long
around recoveries (open faults and joins are closed at their first committed
step), for the job's first step (it names the loss's metrics, which later runs sum
on the status: every rank's own sums come back from a run of one) and when a hook
needs every boundary. A hook (a fault campaign's injector) that has a
``next_step(after)`` method names the boundaries it needs instead, so that its
faults land inside runs as they do in production.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from planaria import store_keys
from planaria.errors import Failure, NonFiniteLoss, Preempted

if TYPE_CHECKING:
    from planaria.controller import Job, StepResult

__all__ = ["RunAhead"]

_log = logging.getLogger("planaria.commits")

MAX_SETTLE_ATTEMPTS = 3


class RunAhead:
    """Runs a job's steps in autonomous runs (see the module doc)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.run_id = 0
        self._stop_sent = False
        self._why: str | None = None
        self._chunks = 0  # stream chunks of the current run read so far
        self._streamed: list[StepResult] = []  # its steps recorded from the stream
        self._ranks: frozenset[str] = frozenset()  # the current run's members
        self._started_t = 0.0  # when the current run's calls went out (wall clock, as events)

    # ---- planning ----------------------------------------------------------------------------

    def next_boundary(self, start: int, until: int) -> int:
        """The step count at which the controller must act next (``> start``)."""
        job = self.job
        if job.recovery.open_work() or job.metric_keys is None:
            return start + 1  # see the module doc; the first step names the loss's metrics
        stop = until
        for hook in job.hooks:  # a hook without next_step needs every boundary
            planned = hook.next_step(start) if hasattr(hook, "next_step") else start + 1
            if planned is not None:
                stop = min(stop, planned)
        ck = job.checkpointer
        if ck is not None:
            due = ck.next_due_step()
            if due is not None and due > start:
                stop = min(stop, due)
        every = job.config.verify_every
        if every is not None and job.width > 1:
            stop = min(stop, (start // every + 1) * every)
        if job.chaos is not None:
            planned = job.chaos.next_step(after=start)
            if planned is not None:
                stop = min(stop, planned)
        return max(start + 1, stop)

    # ---- a run -------------------------------------------------------------------------------

    def run(self, until: int) -> list[StepResult]:
        """The next steps up to ``until`` (at least one) and commits them, or raises the
        Failure that ended the run (its steps that every survivor applied are committed)."""
        job = self.job
        job.boundary()
        start = job.steps_done
        stop = self.next_boundary(start, until)
        assert job.plan is not None
        self.run_id += 1
        self._stop_sent, self._why = False, None
        self._chunks, self._streamed = 0, []
        gen, run_id = job.gen, self.run_id
        plan = (job.plan.num_samples, job.plan.global_batch_size, job.plan.seed)
        members = list(job.members)
        self._ranks = frozenset(h.name for h in members)
        self._started_t = time.time()
        refs = {
            h.name: h.actor.run.remote(
                gen, run_id, start, stop, plan=plan, skipped=job.last_skipped,
                ledger=job.ledger is not None, metric_keys=job.metric_keys or (),
                horizon=job.config.steps,
            )
            for h in members
        }
        job._chaos_during_step(start)
        try:
            results = job._gather(
                refs, deadline_s=job.hang.ceiling_s * (stop - start), step=None,
                poll=self._poll,
            )
        except Failure as failure:
            self._reconcile(failure, start, stop, members)
            raise
        finally:
            self._clear(gen, run_id, len(members))
        head = results[members[0].name]
        job.log.emit("run_ahead", gen=gen, start=start, until=stop,
                     steps=head["steps_done"] - start, ended=head["ended"],
                     why=self._why if head["ended"] == "stop" else None, width=len(members),
                     started_t=self._started_t)
        return self._record(results, members)

    def _poll(self) -> None:
        """While a run goes on: records the steps rank 0 streamed, and ends the run early
        when something unplanned needs a boundary."""
        self._read_stream()
        job = self.job
        job.poll_notices()
        if self._stop_sent or job.evacuating:
            return
        why = job.boundary_wanted()
        if why is None:
            return
        self._stop_sent = True
        self._why = why
        _log.debug("run %d ends early: %s", self.run_id, why)
        job.store.set(store_keys.run_stop(job.gen, self.run_id), why)

    def _read_stream(self) -> None:
        job = self.job
        try:
            key = store_keys.run_stream(job.gen, self.run_id)
            if not job.store.check([key]):
                return
            count = int(job.store.get(key))
            if count > self._chunks:  # steps every rank reduced: all alive and moving
                job.liveness.vouch(self._ranks)
            while self._chunks < count:
                raw = job.store.get(store_keys.run_stream(job.gen, self.run_id, self._chunks))
                self._chunks += 1
                for rec in json.loads(raw):
                    if rec["step"] >= job.steps_done:
                        self._streamed.append(job.record_step(rec))
        except Exception:  # progress only: the run's result brings every record anyway
            _log.debug("could not read run %d's stream", self.run_id, exc_info=True)

    def _clear(self, gen: int, run_id: int, width: int) -> None:
        store = self.job.store
        try:
            for chunk in range(self._chunks):
                store.delete_key(store_keys.run_stream(gen, run_id, chunk))
            store.delete_key(store_keys.run_stream(gen, run_id))
            store.delete_key(store_keys.run_stop(gen, run_id))
            if self.job.ledger is not None:
                for rank in range(width):
                    store.delete_key(store_keys.run_ledger(gen, run_id, rank))
        except Exception:  # the store is ours; a leftover key costs a few bytes
            _log.debug("could not clear run %d's keys", run_id, exc_info=True)

    # ---- recording ---------------------------------------------------------------------------

    def _record(self, results: dict[str, Any], members: list[Any]) -> list[StepResult]:
        """Records a run's steps from rank 0's records (O(1) per step; O(workers) per step
        only with a ledger, whose records come from every rank); the steps streamed
        already are not recorded again (but enter the ledger here)."""
        job = self.job
        head = results[members[0].name]
        ledger = job.ledger is not None
        out: list[StepResult] = list(self._streamed)
        if job.metric_keys is None and head["steps"]:
            self._name_metrics(head["steps"][0], [results[h.name]["steps"] for h in members])
        for i, rec in enumerate(head["steps"]):
            served = {h.name: results[h.name]["steps"][i] for h in members} if ledger else {}
            if not rec["finite"]:
                job.record_nonfinite(rec, served)  # raises NonFiniteLoss: the policy decides
            if ledger:
                job.ledger_step(rec["step"], served)
            if rec["step"] >= job.steps_done:
                out.append(job.record_step(rec))
        last = out[-1].step if out else job.steps_done
        for h in members:
            job._preempt_notice(h.name, results[h.name]["preempting"], last)
        return out

    def _name_metrics(self, rec: dict[str, Any], records: list[list[dict[str, Any]]]) -> None:
        """The job's first run (one step, before the loss's metrics are known): its metrics
        are the sums of every rank's own (each returns its record of a run of one), and
        their names are the ones later runs sum on the status."""
        sums: dict[str, float] = {}
        for recs in records:
            mine = next((r for r in recs if r["step"] == rec["step"]), None)
            for k, v in (mine or {}).get("metric_sums", {}).items():
                sums[k] = sums.get(k, 0.0) + v
        rec["global_metric_sums"] = sums
        if rec["finite"]:
            self.job.metric_keys = tuple(sorted(sums))

    def _reconcile(self, failure: Failure, start: int, stop: int, members: list[Any]) -> None:
        """After a failed run: commits what the furthest survivor applied, marks the
        survivors behind it for a state transfer, and dates the failure to the first
        step not committed."""
        job = self.job
        # Workers leaving on a notice (every holder at once: Job.evacuating) are alive: they
        # settle like survivors, so that the steps they applied are recorded.
        lost = set() if isinstance(failure, Preempted) else set(failure.workers)
        answers: dict[str, Any] = {}
        for _ in range(MAX_SETTLE_ATTEMPTS):
            survivors = [h for h in job.members if h.name not in lost]
            if not survivors:
                break
            try:
                answers = job._gather(
                    {h.name: h.actor.settle_run.remote(job.gen) for h in survivors},
                    deadline_s=60, step=None,
                )
                break
            except Failure as again:  # a survivor failed too: it is lost with the others
                lost |= set(again.workers) or {h.name for h in survivors}
                failure.workers = tuple(dict.fromkeys([*failure.workers, *again.workers]))
        committed = max((a["steps_done"] for a in answers.values()), default=start)
        committed = max(committed, start)
        ahead = next((a for a in answers.values() if a["steps_done"] == committed), None)
        served = self._served_from_store(members) if job.ledger is not None else {}
        if ahead is not None:
            for rec in ahead["steps"]:
                if not start <= rec["step"] < committed:
                    continue
                if job.ledger is not None:
                    job.ledger_step(rec["step"], served.get(rec["step"]) or {})
                if rec["step"] >= job.steps_done:
                    job.record_step(rec)
        job.steps_done = max(job.steps_done, committed)
        job._ledger_served(committed, served.get(committed) or {})  # the broken attempt
        behind = []
        for h in job.members:
            a = answers.get(h.name)
            if a is not None and a["steps_done"] < committed:
                h.has_state = False  # its collective did not complete: it gets the state
                behind.append(h.name)
                _log.info("%s is a step behind after the failure: it receives the state",
                          h.name)
        job.log.emit("run_ahead", gen=job.gen, start=start, until=stop, steps=committed - start,
                     ended="failed", why=failure.kind, width=len(members),
                     committed=committed, behind=behind, started_t=self._started_t)
        failure.step = committed
        if not isinstance(failure, NonFiniteLoss):
            job.log.emit("step_failed", step=committed, gen=job.gen, kind=failure.kind,
                         workers=list(failure.workers))

    def adopt_saved(self, step: int) -> list[int]:
        """A wave's leavers applied the steps up to ``step`` and a save beside them holds
        them, but they were gone before their run settled (no record reached the
        controller): those steps are committed, in the ledger too (what each rank was
        served is in the store), so that the restore of ``step`` continues a training in
        which every sample was used once. Returns the steps committed."""
        job = self.job
        steps = list(range(job.steps_done, step))
        if not steps:
            return []
        served = self._served_from_store(job.members) if job.ledger is not None else {}
        for s in steps:
            if job.ledger is not None:
                if job._ledger_last == (job.gen, s):  # its attempt's records are in already
                    job.ledger.commit(s, gen=job.gen)
                else:
                    job.ledger_step(s, served.get(s) or {})
        job.log.emit("steps_committed_by_save", steps=steps, step=step, gen=job.gen,
                     reason="the leavers applied them before they were gone; the save beside "
                     "them holds them")
        job.steps_done = step
        return steps

    def _served_from_store(self, members: list[Any]) -> dict[int, dict[str, dict[str, Any]]]:
        """{step: {worker: record}} from the ledger keys the run's workers appended to."""
        job = self.job
        out: dict[int, dict[str, dict[str, Any]]] = {}
        for rank in range(len(members)):
            key = store_keys.run_ledger(job.gen, self.run_id, rank)
            try:
                if not job.store.check([key]):
                    continue
                raw = job.store.get(key).decode()
            except Exception:
                _log.warning("could not read %s: its ledger records are lost", key)
                continue
            for line in raw.splitlines():
                if line:
                    rec = json.loads(line)
                    out.setdefault(int(rec["step"]), {})[rec["worker"]] = rec
        return out

