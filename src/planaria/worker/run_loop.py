"""The worker's side of planaria's step protocol: steps run on their own between the
controller's boundaries.

A controller that sent every worker one call per step, waiting for every answer
before the next, would do work per step that grows with the number of workers.
Instead (:meth:`RunLoop.run`) the controller starts a *run* with one call
per worker ("steps ``start`` to ``until`` at this width"; ``Job.train_step`` is a
run of one) and each worker:

- computes its own share of each step's samples from the deterministic data plan;
- runs the step; the gradient all-reduce also sums a small **status** vector
  (the step's loss and sample counts, a "leaving" flag set by a worker that got
  a preemption notice, and a "stop" flag set by rank 0 when the controller asked
  for a boundary), so after the collective every rank knows the same things and
  decides alike, with no round trip to the controller; each rank's step times ride
  after them, in slots of its own (:mod:`planaria.worker.rank_times`), so rank 0's
  records say where every rank's time went;
- applies the step at once when its reduced gradient is finite (the collective
  completing everywhere is the agreement), or stops the run without applying it
  when it is not (the controller's non-finite policy decides, as before);
- with a ledger on, writes what its dataset served into the controller's store
  *before* entering the step's collective, so every committed step's record
  survives the death of the worker that served it.

A run ends at ``until``, after a step whose status says stop or leaving, or at a
non-finite step; it returns the per-step records. When it fails (a peer died, the
generation was aborted), :meth:`RunLoop.settle` reports how far this
worker got and drops a step whose collective did not complete here: the
controller counts the furthest survivor's steps as committed and sends the state
to any survivor behind (see :mod:`planaria.control.run_ahead`).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from planaria.data.plan import DataPlan, micro_batch_ids, split_micro_batches
from planaria.faults.errors import is_consequence
from planaria.faults.points import FaultPoints
from planaria.wire import store_keys
from planaria.wire.reports import (
    Attempt,
    CarriedStep,
    RankTimes,
    RunEnd,
    RunFailed,
    RunReport,
    Settled,
    StepRecord,
    served_line,
    stream_chunk,
)
from planaria.worker.commit import Commits
from planaria.worker.engine import StepComputed, StepEngine
from planaria.worker.key_watch import KeyWatch
from planaria.worker.membership import Membership
from planaria.worker.rank_times import RankSlots
from planaria.worker.vitals import Vitals

__all__ = ["STATUS", "STOP_POLL_S", "STREAM_S", "RunLoop", "StepStream"]

STATUS = ("loss_sum", "samples", "leaving", "stop")
"""The status vector summed in every step's all-reduce, in this order; the sums of the
step's metrics (``metric_keys``, in that order) follow, then the ranks' step times
(:class:`planaria.worker.rank_times.RankSlots`)."""
STOP_POLL_S = 0.05
"""Rank 0 looks for the controller's stop request this often (one store read, made by its
:class:`planaria.worker.key_watch.KeyWatch` thread)."""
STREAM_S = 0.25
"""Rank 0 publishes the records of the steps every rank has applied at most this often."""


class RunLoop:
    """A worker's runs of steps (see the module doc)."""

    def __init__(self, name: str, engine: StepEngine, commits: Commits, membership: Membership,
                 vitals: Vitals, keys: KeyWatch, faults: FaultPoints, *,
                 leads: bool) -> None:
        """``keys`` polls the controller's stop key off the training thread; ``leads``: this
        worker is its replica's leader (shard index 0), whose rank 0 streams the records;
        ``faults``: the worker's fault points (``worker.reduced``, ``worker.applied``)."""
        self.name = name
        self.spec = engine.spec
        self.engine = engine
        self.commits = commits
        self.membership = membership
        self.vitals = vitals
        self.keys = keys
        self.faults = faults
        self.leads = leads
        self.store = membership.store
        self.records: list[StepRecord] = []  # the last run's, settled by settle()
        self._settled: tuple[int, Settled] | None = None  # (gen, answer) once settled
        self._ledger: tuple[int, int, int] | None = None  # (gen, run_id, rank) with a ledger
        self._record_served = self.record_served  # bound once: the engine calls it per step

    def run(
        self, gen: int, run_id: int, start: int, until: int, *, plan: tuple[int, int, int],
        skipped: int, ledger: bool, metric_keys: tuple[str, ...], horizon: int | None,
        carry: CarriedStep | None = None,
    ) -> RunReport | RunFailed:
        """Runs steps ``start`` .. ``until - 1`` (or fewer, see the module doc) on its own.

        ``plan`` is the data plan's (num_samples, global_batch_size, seed); ``skipped``
        the newest step the controller dropped (a non-finite one: it counts as done
        without its update); ``metric_keys`` the loss's metrics, summed over the ranks on
        the status. Each step loads the next one's share ahead, the run's last step too,
        up to ``horizon`` (the job's step count; ``until`` if None): a run of one step
        (``Job.train_step``) finds its share loaded by the run before. ``carry``: the first
        step resumes a failed attempt, this rank keeping what it holds of it and computing
        ``carry.new`` (:mod:`planaria.worker.kept_work`).
        Returns how the run ended; only rank 0 (every rank with a ledger) returns all its
        records, which hold the step's totals: the controller's work per step does not grow
        with the number of workers. A run a peer's failure ended answers RunFailed, with
        this worker settled (:meth:`settle`); any other error is raised.
        """
        self.records = []  # the last run's, settled by settle(), go with it
        self._settled = None
        self.membership.check(gen)
        comm = self.membership.comm
        assert comm is not None, "run before join"
        data_plan = DataPlan(*plan)
        key = store_keys.run_stop(gen, run_id)
        rank = comm.rank
        self._ledger = (gen, run_id, rank) if ledger else None
        if rank == 0:
            self.keys.watch(key, STOP_POLL_S)
        peer_failed: BaseException | None = None
        try:
            with self.keys.busy():
                ended = self._run(gen, run_id, start, until, data_plan, key, skipped,
                                  tuple(metric_keys), until if horizon is None else horizon,
                                  carry)
        except BaseException as err:
            # Whatever ended the run here, no peer may wait on this rank in a collective:
            # tell them to abandon the step, and close the group.
            self.membership.abort_generation(self.commits.steps_done)
            if not self._answers(err):
                raise
            peer_failed = err
        finally:
            self.vitals.committed_t = -math.inf  # not committing: beats again (Vitals.quiet)
            self.keys.forget(key)
            self._ledger = None
        if peer_failed is not None:  # a survivor: settles now and says so
            settled = self.settle(gen)
            self.vitals.set_phase("idle", self.commits.steps_done)
            return RunFailed(error=f"{type(peer_failed).__name__}: {peer_failed}",
                             settled=settled)
        # Kept until the next run: a run that ended here while the controller saw a failure
        # (a preemption wave answered in flight) is settled from them (settle).
        records = list(self.records)
        self.vitals.set_phase("idle", self.commits.steps_done)
        if rank != 0 and not ledger:
            records = records[-1:]  # its last step only: how far it got
        return RunReport(steps=records, ended=ended, steps_done=self.commits.steps_done,
                         preempting=self.vitals.preempting)

    def _run(
        self, gen: int, run_id: int, start: int, until: int, data_plan: DataPlan, key: str,
        skipped: int, metric_keys: tuple[str, ...], horizon: int,
        carry: CarriedStep | None,
    ) -> RunEnd:
        comm = self.membership.comm
        assert comm is not None
        width, rank, mbs = comm.world_size, comm.rank, self.spec.micro_batch_size
        device = getattr(comm, "device", None) or torch.device("cpu")
        ended: RunEnd = "until"
        done = start  # the steps this run counts as committed (the first step settles)
        step = start
        stream = StepStream(self.store, gen, run_id) if rank == 0 and self.leads else None
        vitals, faults, records = self.vitals, self.faults, self.records
        record_served = self._record_served if self._ledger is not None else None
        k = self.engine.state.shape.k  # a sharded replica's workers share its rank's slots
        slots = RankSlots(offset=len(STATUS) + len(metric_keys), width=width,
                          room=self.engine.state.reducer.status_room())
        # One status for the run, zeroed each step: its length is fixed until the width changes.
        status = slots.new_status(device)
        reduce_wait_s = reduced_t = 0.0  # the previous step's, sent with the next

        def share(s: int) -> np.ndarray:  # this rank's ids of step s
            return split_micro_batches(data_plan.batch(s), width, mbs)[rank]

        if carry is not None and carry.step != start:
            carry = None  # not this run's first step: nothing to resume
        nxt: np.ndarray | None = (share(start) if carry is None else
                                  micro_batch_ids(data_plan.batch(start), carry.new, mbs))
        while step < until:
            ids = nxt
            assert ids is not None
            nxt = share(step + 1) if step + 1 < max(until, horizon) else None
            stop_seen = rank == 0 and self.keys.seen(key)  # polled off this thread
            status.zero_()
            slots.cells[2] = float(vitals.preempting)  # written through a host view: cheaper
            slots.cells[3] = float(stop_seen)
            if step > start:  # the previous step's reduce-wait, and its apply until now
                slots.write_previous(step, rank, reduce_wait_s / k,
                                     (time.perf_counter() - reduced_t) / k)
            t0 = time.time()
            c = self.engine.step(gen, step, ids, done, nxt, skipped=skipped, status=status,
                                 metric_keys=metric_keys, record_served=record_served,
                                 rank_slots=slots, carry=carry)
            carry = None
            reduced_t, reduce_wait_s = time.perf_counter(), c.reduce_wait_s
            skipped = -1
            if faults.armed:  # a fault injected after the reduction
                faults.hit("worker.reduced", step=step)
            values = status.tolist()
            loss_sum, samples, leaving, stop = values[:4]
            global_metric_sums = dict(zip(metric_keys, values[4 : slots.offset], strict=True))
            finite = math.isfinite(loss_sum) and (c.overflow or math.isfinite(c.grad_norm))
            ranks = slots.read(values, step)
            last = records[-1] if records else None
            if last is not None and last.step == step - 1 and last.ranks is not None:
                records[-1] = replace(last, ranks=slots.complete(last.ranks, values))
            if not finite:
                records.append(_record(step, t0, c, finite=False, loss_sum=loss_sum,
                                       samples=int(samples), metric_sums=global_metric_sums,
                                       ranks=ranks))
                ended = "nonfinite"  # not applied: the controller's policy decides
                break
            done = step + 1
            self.commits.settle(done)  # applies the step now
            vitals.committed_t = time.monotonic()  # progress is the heartbeat (see liveness)
            if faults.armed:  # a fault injected after the apply
                faults.hit("worker.applied", step=step)
            records.append(_record(step, t0, c, finite=True, loss_sum=loss_sum,
                                   samples=int(samples), metric_sums=global_metric_sums,
                                   ranks=ranks))
            if stream is not None:
                # This step's reduction completed: every rank applied the steps before it.
                stream.publish(records, len(records) - 1)
            step += 1
            if leaving > 0:
                ended = "leaving"
                break
            if stop > 0:
                ended = "stop"
                break
        return ended

    def settle(self, gen: int) -> Settled:
        """After a failed run: drops a step whose collective did not complete here, and
        reports how far this worker got, the records of the steps it applied and what it
        keeps of the step that failed (:meth:`StepEngine.hold_finished`). Asked again in
        the same generation (the run answered with it, RunFailed), the same answer."""
        self.membership.enter(gen)  # a newer generation may be forming
        if self._settled is not None and self._settled[0] == gen:
            return self._settled[1]
        held = self.engine.hold_finished()  # kept apart: the pending gradient goes
        if self.commits.pending is not None:
            self.commits.drop_pending()
        records, self.records = self.records, []
        settled = Settled(steps_done=self.commits.steps_done, steps=records, held=held)
        self._settled = (gen, settled)
        return settled

    def _answers(self, err: BaseException) -> bool:
        """A run a peer's failure ended here is answered (RunFailed), not raised; not in a
        sharded replica (its leader merges its workers' errors, planaria.worker.replica)."""
        return self.engine.state.shape.k == 1 and is_consequence(err)

    def record_served(self, attempt: Attempt) -> None:
        """With a ledger, what this rank was served for the attempt's step, into the store
        before the step's collective: a committed step's record outlives the worker."""
        hook = self._ledger
        if hook is None:
            return
        gen, run_id, rank = hook
        self.store.append(store_keys.run_ledger(gen, run_id, rank),
                          served_line(attempt.step, self.name, attempt.served))


def _record(step: int, t0: float, c: StepComputed, *, finite: bool, loss_sum: float,
            samples: int, metric_sums: dict[str, float], ranks: RankTimes | None) -> StepRecord:
    """The record of step ``step``: this rank's part ``c`` and the step's totals over every
    rank (``loss_sum``, ``samples``, ``metric_sums``, ``ranks``, off the reduced status); its
    ``t`` is now, when it was applied or found not finite."""
    return StepRecord(
        step=step, t0=t0, t=time.time(), grad_norm=c.grad_norm, overflow=c.overflow, lr=c.lr,
        finite=finite, data_wait_s=c.data_wait_s, global_loss_sum=loss_sum,
        global_samples=samples, global_metric_sums=metric_sums, served=c.served,
        metric_sums=c.metric_sums, compute_s=c.compute_s, reduce_s=c.reduce_s, ranks=ranks,
    )


class StepStream:
    """Rank 0's records, published every :data:`STREAM_S` as chunks under
    ``store_keys.run_stream`` (two store writes a chunk), for the controller's progress
    display, metrics and event log while the run goes on."""

    def __init__(self, store: Any, gen: int, run_id: int) -> None:
        self.store, self.gen, self.run_id = store, gen, run_id
        self.sent = 0  # records published
        self.chunks = 0
        self.last = time.monotonic()

    def publish(self, records: list[StepRecord], upto: int) -> None:
        """``records[:upto]`` that were not published yet, if ``STREAM_S`` has passed."""
        if upto <= self.sent or time.monotonic() - self.last < STREAM_S:
            return
        self.store.set(store_keys.run_stream(self.gen, self.run_id, self.chunks),
                       stream_chunk(records[self.sent:upto]))
        self.chunks += 1
        self.store.set(store_keys.run_stream(self.gen, self.run_id), str(self.chunks))
        self.sent, self.last = upto, time.monotonic()
