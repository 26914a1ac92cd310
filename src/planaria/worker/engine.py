"""One step of a replica: its share loaded, forward and backward over its micro-batches,
the gradient reduced with its peers. Nothing is applied here (see
:mod:`planaria.worker.commit`).

Before micro-batch j of step s, torch (CPU and CUDA) is seeded from
``(seed, s, j)``: what a micro-batch computes does not depend on the width or on
the rank that runs it. The loss of a micro-batch of n samples is scaled by
``n / global_batch`` so that the reduced gradient is the global batch's mean. A
rank whose user code raised tells its peers to abandon the step (and closes its
group, so that none waits on it in a collective) and raises with its traceback.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from planaria.data.randomness import micro_batch_seed, seed_torch
from planaria.faults.errors import Failure, PlanariaError, StepAborted, Work
from planaria.faults.points import FaultPoints
from planaria.faults.user_code import user_call
from planaria.wire.reports import Attempt, CarriedStep, HeldWork, Served
from planaria.worker.busy import current_thread_ids
from planaria.worker.collective import Collective
from planaria.worker.commit import Commits
from planaria.worker.custom_step import StepBackward
from planaria.worker.kept_work import KeptWork
from planaria.worker.loader import Loaded, SampleLoader, to_device
from planaria.worker.membership import Membership
from planaria.worker.rank_times import RankSlots
from planaria.worker.replica import replica_failed
from planaria.worker.replica_state import ReplicaState
from planaria.worker.vitals import Vitals

__all__ = ["StepComputed", "StepEngine"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepComputed:
    """A step computed and reduced here, not applied yet: this rank's part of its record
    (:class:`planaria.wire.reports.StepRecord`). ``grad_norm`` is the reduced gradient's
    (an fp16 step's unscaled); ``overflow``: a loss scaler's scale was too high;
    ``reduce_wait_s``: the time blocked in the reduction (the next share's load while it
    was in flight left out)."""

    grad_norm: float
    overflow: bool
    lr: float
    metric_sums: Mapping[str, float]
    served: Served
    data_wait_s: float
    compute_s: float
    reduce_s: float
    reduce_wait_s: float


class StepEngine:
    """Computes and reduces a step's gradient (:meth:`step`)."""

    def __init__(self, name: str, state: ReplicaState, commits: Commits, loader: SampleLoader,
                 membership: Membership, vitals: Vitals, faults: FaultPoints) -> None:
        """``faults``: the worker's fault points (``worker.loaded``, ``worker.computed``: see
        :data:`planaria.faults.points.WORKER_POINTS`)."""
        self.name = name
        self.spec = state.spec
        self.state = state
        self.commits = commits
        self.loader = loader
        self.membership = membership
        self.vitals = vitals
        self.faults = faults
        self.sharded = state.shape.k > 1
        self.last_attempt: Attempt | None = None  # what the last step was served
        self._load_planned = loader.load_planned
        self._ahead_s = 0.0  # how long the last reduction's load of the next share took
        self._load_ahead = self._timed_load_ahead  # bound once: run while the reduce is in flight
        self._backward = StepBackward(sharded=self.sharded)  # armed per micro-batch
        self.kept = KeptWork()  # the current attempt's progress; a failed one's finished part

    def step(
        self, gen: int, step: int, ids: np.ndarray, steps_done: int,
        next_ids: np.ndarray | None, *, skipped: int, status: torch.Tensor,
        metric_keys: tuple[str, ...], record_served: Callable[[Attempt], None] | None,
        rank_slots: RankSlots | None = None, carry: CarriedStep | None = None,
    ) -> StepComputed:
        """Computes step ``step`` on ``ids`` and reduces the gradient; applies nothing yet.

        ``steps_done`` is the run's count of committed steps: if this worker's pending
        step is among them it is applied first, otherwise it is dropped; ``skipped`` is
        the newest step whose update the controller dropped (a non-finite one): it counts
        as done. ``status`` (see :mod:`planaria.worker.run_loop`) is summed over the ranks
        in the gradient's own all-reduce, in place, the sums of ``metric_keys`` after its
        fixed slots. ``next_ids`` (this rank's share of the next step) load on the loader
        thread, or on this one while the reduction is in flight. ``record_served(attempt)``,
        if given, is called once the share is loaded, before the reduction. ``rank_slots``:
        where this rank's load and compute times go in the status, if they go there.
        ``carry``: the step resumed after a fault (``ids``: its ``carry.new`` micro-batches'),
        this rank's held part restored first (:mod:`planaria.worker.kept_work`).
        """
        self.state.refuse_if_dirty(self.name, "step")
        self.vitals.train_thread = current_thread_ids()
        self.commits.settle(steps_done, skipped)
        if step != self.commits.steps_done:
            raise PlanariaError(
                f"{self.name} asked for step {step} but has {self.commits.steps_done} done")
        # From here the gradient holds this step's (maybe partial) gradient: if the step
        # fails anywhere, the next settle drops it rather than apply or accumulate it.
        self.commits.pending = step
        comm = self.membership.comm
        assert comm is not None, "step before join"
        copy, kept = self.state.reducer.gradient_copy(), self.kept
        if carry is None:
            first, count, ids, rounds = self.loader.own_share(ids, comm)
            kept.start(step, first, None, None, copy, count)
        else:  # the step resumed: its held part back in the buffers, its new part to compute
            prior = kept.resume(carry, self.commits.steps_done, copy)
            first, count = carry.new[0] if carry.new else 0, len(carry.new)
            rounds = count
            kept.start(step, first, carry.new, prior, copy)
        ahead_s, self._ahead_s = self._ahead_s, 0.0  # this share, loaded in the last reduce
        t0 = time.perf_counter()
        self.state.reducer.start_step()
        try:
            loaded = self._load(gen, step, ids, first, record_served)
            data_wait_s = time.perf_counter() - t0
            self._plan_ahead(next_ids, step, first, comm)
            loss_sum, metric_sums = self._compute(step, loaded, first, rounds, comm)
        except Failure as err:
            self._fail(err, step)
            raise
        except StepAborted:
            self.membership.abort_generation(step)
            raise
        faults = self.faults
        if faults.armed:  # a fault injected before the reduction
            faults.hit("worker.computed", step=step)
        t1 = time.perf_counter()
        if rank_slots is not None:  # a sharded replica's slot: its workers' mean
            k = self.state.shape.k
            rank_slots.write_own(step, comm.rank, (data_wait_s + ahead_s) / k,
                                 (t1 - t0 - data_wait_s) / k)
        if self.state.incoming is not None:  # a joiner's state, its optimizer's part arriving
            self.vitals.set_phase("recv_state", step)
            try:
                self.state.await_incoming()
            except BaseException:  # the step fails as a failed reduction would
                comm.close()  # the peers waiting in the reduction see it now
                raise
        reduce_wait_s = self._reduce(step, loaded, first, count, comm, status, metric_keys,
                                     loss_sum, metric_sums)
        return self._result(step, metric_sums, t0, t1, data_wait_s, reduce_wait_s)

    def hold_finished(self) -> HeldWork | None:
        """After a failed run, before its pending step is dropped: the finished micro-batches
        of that step this rank keeps (their gradient sum in the reducer's copy), if it can
        (:mod:`planaria.worker.kept_work`)."""
        state = self.state
        keepable = (state.shape.k == 1 and state.scaler is None
                    and not state.buffer_sync.active
                    and state.incoming is None)  # not a joiner whose state did not all arrive
        return self.kept.settle(self.commits.steps_done, self.commits.pending,
                                state.reducer.gradient_copy(), keepable)

    def warm_up(self, *, joiner: bool = False) -> None:
        """One forward and backward of a micro-batch of the dataset's first samples (the
        shape of every step's micro-batches), off the critical path, then the model's state
        and the gradients put back as they were (a ``joiner``'s state is not: every tensor
        of it is overwritten by the state it is sent or restores, and a start over from
        step 0 builds it again, so a copy would only be memory to touch: 1-1.4 CPU-seconds
        at the ``realistic`` size, half of a joiner's setup, taken from the steps beside
        it).

        With ``spec.compile`` it compiles the model. In a replacement or a spare it also
        does what a process's first forward and backward would do on the critical path of
        its first step after joining: the allocator takes and touches the memory of the
        activations and the gradients' temporaries (on a GPU, the kernels' handles are
        created too), which the whole width would wait for at the all-reduce. Measured at
        the ``realistic`` size (bench/common.py, 2 cores, 7 joins a run): the joiner's
        compute in its first step over the others' median 0.07 s (0.03-0.15) without, 0.03
        (0.01-0.07) with; that step 1.049 s against 1.005 at full width without, 0.986
        against 0.992 with."""
        loader, model = self.loader, self.state.model
        n = user_call("len(dataset)", len, loader.dataset)
        samples = [loader.fingerprint_sample(i % n) for i in range(self.spec.micro_batch_size)]
        batch = to_device(user_call("collate", loader.collate, samples), self.state.device)
        self.state.wait_readers()  # the state is written back below
        saved = None if joiner else {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.train()
        torch.manual_seed(self.spec.seed)
        if self.spec.forward_backward is not None:
            self._backward.run(self.spec.forward_backward, self.state.compiled, batch, 1.0,
                               None, None)
        else:
            loss_fn = cast(Callable[..., Any], self.spec.loss)
            out = user_call("the loss function", loss_fn, self.state.compiled, batch)
            loss = out[0] if isinstance(out, tuple) else out
            user_call("backward", loss.backward)
        if saved is not None:
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    v.copy_(saved[k])
        self.commits.drop_pending()

    def _load(self, gen: int, step: int, ids: np.ndarray, first: int,
              record_served: Callable[[Attempt], None] | None) -> Loaded:
        """This rank's share, loaded (or taken from what was loaded ahead)."""
        self.vitals.set_phase("loading", step)
        self.state.copy_fence.go()  # a save's copy runs beside this step (its reply is sent)
        reducer = self.state.reducer
        try:
            loaded = self.loader.take(ids, step, first)
        except Failure as err:
            if self.sharded:  # the replica's others learn it: all leave whole
                reducer.agree_loaded(False)
                err.replica_intact = True  # type: ignore[attr-defined]
            raise
        reducer.agree_loaded(True)
        served = loaded.served
        faults = self.faults
        if faults.armed:  # a fault injected before the compute
            faults.hit("worker.loaded", step=step)
        mine = Served(ids=served.ids, digests=served.digests if served.digests_on else None)
        kept = self.kept
        if kept.prior is not None:  # a resumed step: what the held micro-batches were served
            mine = Served.merge([kept.prior.served, mine])
        kept.served, kept.counts = mine, loaded.batches
        self.last_attempt = attempt = Attempt(gen=gen, step=step, served=mine)
        if record_served is not None:  # the run's ledger, before the collective
            record_served(attempt)
        return loaded

    def _plan_ahead(self, next_ids: np.ndarray | None, step: int, first: int,
                    comm: Collective) -> None:
        """The next step's share starts loading on the loader thread, or is planned to load
        on this one during the reduction."""
        ahead: np.ndarray | None = None
        if next_ids is not None and len(next_ids):
            first, _, ahead, _ = self.loader.own_share(next_ids, comm)
            if self.loader.prefetch_on:
                self.loader.prefetch(ahead, step + 1, first)
                ahead = None
        self.loader.plan_ahead(ahead, step + 1, first)

    def _compute(self, step: int, loaded: Loaded, first: int, rounds: int, comm: Collective
                 ) -> tuple[float, dict[str, float]]:
        """Forward and backward over the share's micro-batches; returns the loss's sum and
        the metrics' sums over its samples."""
        self.vitals.set_phase("compute", step)
        state, vitals, membership = self.state, self.vitals, self.membership
        with state.lock:  # the committed buffers, kept as a snapshot beside reads them
            state.buffer_sync.begin()  # buffers are pending: put back unless the step commits
        state.model.train()
        kept = self.kept
        numbers, prior = kept.numbers, kept.prior  # a resumed step's micro-batches; held
        loss_sum = 0.0 if prior is None else prior.loss_sum
        metric_sums: dict[str, float] = {} if prior is None else dict(prior.metric_sums)
        gbs = self.spec.global_batch_size
        forward_backward, backward = self.spec.forward_backward, self._backward
        loss_fn = cast(Callable[..., Any], self.spec.loss)  # set when forward_backward is not
        autocast_device = None if self.spec.precision is None else state.device.type
        last = len(loaded.batches) - 1
        # A sharded replica's workers run as many forwards as each other (FSDP's
        # collectives pair them): one with fewer micro-batches pads with a weightless one.
        real = [b for _, b in loaded.batches if b is not None]
        padding = [(0, real[0] if real else None)] * (rounds - len(loaded.batches))
        for j, (n, batch) in enumerate(loaded.batches + padding):
            try:
                membership.raise_if_aborted(step)
            except StepAborted:  # between micro-batches: the finished ones can be kept
                kept.reached(j, loss_sum, metric_sums)
                raise
            if j == last:
                state.reducer.before_last_backward(comm)
            if batch is None:  # every sample of it skipped (a work fault): no forward,
                if not self.sharded or not real:  # or (FSDP pairs the replica's
                    vitals.progress += 1  # forwards) a weightless one
                    continue
                batch = real[0]
            index = first + j if numbers is None else numbers[j]  # its global number
            vitals.work = f"m{index}"
            # A weightless forward leaves the buffers (BatchNorm's statistics) as they were.
            held = state.buffer_sync.hold() if not n and self.sharded else None
            # The micro-batch's own random stream: the same at any width, on any rank.
            seed_torch(micro_batch_seed(self.spec.seed, step, index))
            try:
                if forward_backward is not None:  # the user's step calls backward itself
                    with self._autocast():
                        loss, metrics = backward.run(forward_backward, state.compiled, batch,
                                                     n / gbs, state.scaler, autocast_device)
                else:
                    with self._autocast():
                        out = user_call("the loss function", loss_fn, state.compiled, batch)
                    loss, metrics = out if isinstance(out, tuple) else (out, {})
                    scaled = loss * (n / gbs)
                    if state.scaler is not None:
                        scaled = state.scaler.scale(scaled)
                    user_call("backward", scaled.backward)
            except Failure as err:
                err.work = Work(step=step, micro_batch=index)
                raise
            if held is not None:
                state.buffer_sync.put_back(held)
            if n:
                loss_sum += float(loss.detach()) * n
                for key, value in metrics.items():
                    metric_sums[key] = metric_sums.get(key, 0.0) + float(value) * n
            vitals.progress += 1
        kept.reached(len(loaded.batches), loss_sum, metric_sums)  # reduced next, or kept
        membership.raise_if_aborted(step)
        return loss_sum, metric_sums

    def _autocast(self) -> Any:
        """The forward's mixed precision (``spec.precision``); a no-op in full precision."""
        if self.spec.precision is None:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.spec.precision == "bf16" else torch.float16
        return torch.autocast(self.state.device.type, dtype=dtype)

    def _fail(self, err: Failure, step: int) -> None:
        """This step is lost whatever happens: the peers abandon it now (they look between
        micro-batches) and the group closes, so that none waits in a collective."""
        self.membership.abort_generation(step)
        err.workers, err.step = (self.name,), step
        if err.work is None:
            err.work = Work(step=step)
        shape = self.state.shape
        if shape.shard_index and not getattr(err, "replica_intact", False):
            replica_failed(self.state.store, shape.replica_key, shape.shard_index, err)

    def _reduce(self, step: int, loaded: Loaded, first: int, count: int, comm: Collective,
                status: torch.Tensor, metric_keys: tuple[str, ...], loss_sum: float,
                metric_sums: dict[str, float]) -> float:
        """Sums the gradient, the module buffers' contributions and the status over the
        ranks; the next step's share loads meanwhile. Returns the time blocked in it."""
        self.vitals.set_phase("reduce", step)
        spec, state = self.spec, self.state
        k, shard = state.shape.k, state.shape.shard_index  # a sharded replica's workers
        extra = state.buffer_sync.contributions(  # each runs micro-batches of its own
            rank=comm.rank * k + shard, width=comm.world_size * k, first=first, count=count,
            total=spec.global_batch_size // spec.micro_batch_size,
        )
        # The step's totals, known to every rank after the reduction.
        status[2] = max(float(status[2]), float(self.vitals.preempting))  # a notice mid-step
        status[0] += loss_sum
        prior = self.kept.prior
        status[1] += sum(n for n, _ in loaded.batches) + (0 if prior is None else prior.samples)
        for i, key in enumerate(metric_keys):
            status[4 + i] += metric_sums.get(key, 0.0)
        t = time.perf_counter()
        try:
            norm = state.reducer.reduce(comm, status, extra, self._load_ahead)
        except BaseException:
            self.membership.abort_generation(step)  # no peer waits on this rank next
            raise
        waited = time.perf_counter() - t - self._ahead_s
        state.buffer_sync.reduced(extra)
        self.commits.grad_norm = norm
        return waited

    def _timed_load_ahead(self) -> None:
        """The next step's share, loaded while the reduction is in flight, and how long that
        took (the next step's load time, not this one's wait)."""
        t = time.perf_counter()
        self._load_planned()
        self._ahead_s = time.perf_counter() - t

    def _result(self, step: int, metric_sums: dict[str, float], t0: float, t1: float,
                data_wait_s: float, reduce_wait_s: float) -> StepComputed:
        """This rank's part of the step's record; an fp16 step's norm unscaled, and whether
        it overflowed."""
        overflow = False
        scaler = self.state.scaler
        if scaler is not None:  # the buffers hold scaled gradients
            self.commits.grad_norm /= scaler.get_scale()
            # The same on every replica (the gradient is reduced): all skip it alike at apply.
            overflow = not math.isfinite(self.commits.grad_norm)
        t2 = time.perf_counter()
        self.vitals.set_phase("idle", step)
        attempt = self.last_attempt
        assert attempt is not None
        return StepComputed(
            grad_norm=self.commits.grad_norm, overflow=overflow, metric_sums=metric_sums,
            lr=_learning_rate(self.state.optimizer),  # the lr this step is applied with
            served=attempt.served,  # what dataset[i] was called with, not an echo of ids
            data_wait_s=data_wait_s, compute_s=t1 - t0 - data_wait_s, reduce_s=t2 - t1,
            reduce_wait_s=reduce_wait_s,
        )


def _learning_rate(optimizer: Any) -> float:
    """The first parameter group's learning rate; NaN where it has none (an optimizer that
    sets its own step size) or it is not a number."""
    try:
        return float(optimizer.param_groups[0]["lr"])
    except (KeyError, IndexError, TypeError, ValueError):
        return math.nan
