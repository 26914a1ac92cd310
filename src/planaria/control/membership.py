"""Membership: generations of workers, fencing, and who holds the training state.

Every call to a worker carries its generation (invariant 3 in DESIGN.md): a worker
evicted is fenced off, and the next generation is a new process group over the
members in rank order. Replacements that join receive the state from a member
that holds it; waiting for them is one loop (:meth:`Membership.wait_for_replacements`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray
import torch

from planaria.data.integrity import describe_mismatch
from planaria.faults import points
from planaria.faults.errors import DataMismatch, ElasticRuntimeError, InternalError
from planaria.wire.takeover import Lease

if TYPE_CHECKING:
    from planaria.config import RunConfig
    from planaria.control.commit_log import CommitLog
    from planaria.control.hooks import FaultHooks
    from planaria.control.pool import WorkerHandle, WorkerPool
    from planaria.control.protocols import Gather
    from planaria.control.takeover import Takeover
    from planaria.control.watchdog import StepDeadline
    from planaria.observe.events import EventLog
    from planaria.wire.reports import Joined
    from planaria.wire.state_reports import StateMeta

__all__ = ["Membership"]

_mlog = logging.getLogger("planaria.membership")


class Membership:
    """A job's members (rank order) and generation; builds the next generation.

    The pool and the calls come with :meth:`connect`, once the job's store is up: before
    it the membership is empty, at generation -1.
    """

    pool: WorkerPool
    calls: Gather

    def __init__(self, *, config: RunConfig, log: EventLog, deadline: StepDeadline,
                 commit_log: CommitLog, hooks: FaultHooks) -> None:
        self.config = config
        self.log = log
        self.deadline = deadline
        self.commit_log = commit_log
        self.hooks = hooks
        self.gen = -1
        self.members: list[WorkerHandle] = []
        self.lease_epoch = 1  # the run's first controller's; a takeover's is greater

    def connect(self, pool: WorkerPool, calls: Gather) -> None:
        self.pool = pool
        self.calls = calls

    @property
    def lease(self) -> Lease:
        """This controller's lease, told to the workers with every join."""
        return Lease(run_id=self.commit_log.run_id, epoch=self.lease_epoch)

    @property
    def width(self) -> int:
        return len(self.members)

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.members]

    def with_followers(self, names: list[str]) -> list[str]:
        """``names`` and, for a sharded replica, its other workers (``w<N>.<i>``): each one's
        own heartbeat is watched (a stopped follower stalls its leader in a collective)."""
        k = self.config.workers_per_replica
        if k == 1:
            return names
        return [*names, *(f"{n}.{i}" for n in names for i in range(1, k))]

    # ---- who holds the state -----------------------------------------------------------------

    def add(self, handles: Sequence[WorkerHandle]) -> None:
        """``handles`` become members; the next generation built makes them ranks."""
        self.members = self.members + list(handles)

    def set_holding(self, names: Sequence[str], holds: bool) -> None:
        """Marks ``names`` as holding the committed state (a restore will overwrite theirs)
        or not (they are behind and receive it when the next generation is built)."""
        for h in self.members:
            if h.name in names:
                h.has_state = holds

    def restore_from(self, takeover: Takeover, handles: Sequence[WorkerHandle]) -> None:
        """Takes over another controller's workers (:mod:`planaria.control.takeover`):
        ``handles`` (those of ``takeover.members``) become the members in its rank order,
        holding the state as it says, under its lease epoch; the next generation built is
        ``takeover.next_gen``."""
        by_name = {h.name: h for h in handles}
        missing = [n for n in takeover.members if n not in by_name]
        if missing:
            raise ElasticRuntimeError(f"no handle for the members {missing} to take over")
        self.members = [by_name[n] for n in takeover.members]
        self.set_holding(takeover.holders, True)
        self.set_holding(takeover.behind, False)
        self.gen = takeover.next_gen - 1
        self.lease_epoch = takeover.lease_epoch

    def kill_all(self) -> None:
        """Kills (and fences off) every member: the membership is empty."""
        for handle in self.members:
            self.pool.kill(handle, fence=True)
        self.members = []

    def build_generation(self, members: list[WorkerHandle], *, reason: str) -> None:
        """Makes ``members`` (rank order) the next generation and sends state to newcomers.

        Raises a Failure if a member fails meanwhile; the caller recovers from it.
        """
        t0 = time.time()
        self.settle_receipts()
        for h in members:  # a receipt still pending ends with its group: sent the state again
            if h.receiving is not None:  # every receipt has its outcome in the log
                self.log.emit("state_received", worker=h.name, ok=False,
                              error="its generation ended before the rest arrived")
            h.receiving = None
        self.gen += 1
        gen = self.gen
        self.members = list(members)
        self.deadline.rescale(len(members))  # per-rank work scales with 1/width
        timeouts = (self.config.join_timeout_s, self.config.collective_timeout_s)
        # Each rank starts loading its share of the next step while the group forms.
        steps_done = self.commit_log.steps_done
        parts = self.commit_log.split(steps_done, len(members))
        lease = self.lease
        refs = {
            h.name: h.actor.join.remote(
                gen, rank, len(members), steps_done, timeouts, parts[rank],
                skipped=self.commit_log.last_skipped,
                skip=tuple(sorted(self.commit_log.skipped_samples)), lease=lease,
            )
            for rank, h in enumerate(members)
        }
        results: dict[str, Joined] = self.calls.gather(
            refs, deadline_s=self.config.join_timeout_s + 5, step=None)
        self.commit_log.ledger_dropped(results)
        for h in members:
            behind = results[h.name].steps_done != steps_done
            # A restore overwrites every member's state: fresh replacements may be behind.
            if h.has_state and reason != "restore" and behind:
                raise InternalError(
                    f"{h.name} has {results[h.name].steps_done} steps, the job "
                    f"{steps_done}: its state is not the job's",
                    workers=(h.name,),
                )
        joiners = [r for r, h in enumerate(members) if not h.has_state]
        if joiners:
            self.send_state(joiners)
        self.log.emit(
            "generation",
            gen=gen,
            workers=self.names,
            world_size=len(members),
            build_s=time.time() - t0,
            reason=reason,
            epoch=self.lease_epoch,
        )
        _mlog.info("generation %d: %s (%s)", gen, self.names, reason)

    def send_state(self, joiners: list[int]) -> None:
        points.hit("membership.send_state", membership=self, joiners=joiners)
        src_rank = next((r for r, h in enumerate(self.members) if h.has_state), None)
        if src_rank is None:
            raise InternalError("no member holds the state to send to the joiners")
        src = self.members[src_rank]
        t0 = time.time()
        source: StateMeta = self.calls.gather(
            {src.name: src.actor.state_meta.remote(self.gen, self.config.state_beside_step)},
            deadline_s=60, step=None,
        )[src.name]
        nbytes = sum(math.prod(shape) * getattr(torch, dtype).itemsize
                     for shape, dtype in source.tensors())
        if source.beside and nbytes / self.config.min_transfer_bytes_per_s > (
                self.config.collective_timeout_s / 2):
            # The first step's reduction waits for the rest: it must arrive well within
            # the collective's timeout even at the slowest rate a transfer is allowed.
            source = dataclasses.replace(source, beside=False)
        by_memory = self.config.state_by_memory
        source = dataclasses.replace(source, by_memory=by_memory, shards=tuple(
            dataclasses.replace(s, by_memory=by_memory) for s in source.shards))
        refs = {src.name: src.actor.send_state.remote(self.gen, joiners, source.beside)}
        for r in joiners:
            h = self.members[r]
            refs[h.name] = h.actor.recv_state.remote(self.gen, src_rank, source)
        self.hooks.call("join", src=src.name, joiners=[self.members[r].name for r in joiners])
        # A transfer that moves bytes is busy: its deadline grows with them (a 30 GB shard on
        # 1 GbE takes minutes), and past it the workers are judged by their bytes moving.
        deadline = (self.config.collective_timeout_s
                    + len(joiners) * nbytes / self.config.min_transfer_bytes_per_s)
        sizes = self.calls.gather(refs, deadline_s=deadline, step=None)
        seconds = time.time() - t0
        nbytes = int(sizes[src.name])
        for r in joiners:
            h = self.members[r]
            if source.beside:  # it holds the state once the rest has arrived
                h.receiving = h.actor.state_received.remote(self.gen, deadline)
            else:
                h.has_state = True
        # Beside the step, ``seconds`` is the stall (the model's bytes), not the transfer's.
        self.log.emit(
            "state_transfer",
            src=src.name,
            dst=[self.members[r].name for r in joiners],
            bytes=nbytes,
            seconds=seconds,
            gb_per_s=nbytes / seconds / 1e9 if seconds > 0 and not source.beside else None,
            beside=source.beside,
        )

    def settle_receipts(self) -> None:
        """Members whose state arrived beside a step hold it once all of it has arrived; one
        whose receipt failed holds none (it is sent the state again, or restores). Does not
        wait: one still receiving is not a holder yet."""
        pending = [h for h in self.members if h.receiving is not None]
        if not pending:
            return
        ready, _ = ray.wait([h.receiving for h in pending], num_returns=len(pending),
                            timeout=0)
        done = set(ready)
        for h in pending:
            if h.receiving not in done:
                continue
            ref, h.receiving = h.receiving, None
            try:
                seconds, routes = ray.get(ref)
            except Exception as err:  # any failure: it holds no state
                _mlog.info("%s did not receive the state: %s", h.name, err)
                self.log.emit("state_received", worker=h.name, ok=False, error=str(err)[:300])
                continue
            h.has_state = True
            self.log.emit("state_received", worker=h.name, ok=True, rest_s=seconds,
                          routes=routes)

    def evict(self, names: Sequence[str], *, kill: bool = True) -> None:
        """Removes workers from the membership, fencing them off (and killing them)."""
        for handle in [h for h in self.members if h.name in names]:
            self.members.remove(handle)
            if kill:
                self.pool.kill(handle)
            else:
                self.pool.fence(handle.name)


    def start_members(self, *, timeout_s: float) -> WorkerHandle:
        """The job's first members, once ready (``config.replicas`` of them, in name order),
        hold the state (the seed's); returns rank 0. Raises ElasticRuntimeError if fewer
        were ready in time, or if they did not build the same model and dataset."""
        count = self.config.replicas
        ready = self.wait_ready(count, timeout_s=timeout_s)
        ready.sort(key=lambda h: int(h.name[1:]))
        self.add(ready)  # so that closing the job releases them if a check below fails
        if len(ready) < count:
            failed = self.pool.last_start_error
            raise ElasticRuntimeError(
                f"only {len(ready)} of {count} workers started within the deadline: "
                + (f"the last start failed with {failed}" if failed else
                   "none failed; check the Ray cluster has the CPUs/GPUs asked for "
                   "(cpus_per_worker, use_gpu)")
            )
        self.check_same_init(ready)
        self.set_holding(self.names, True)
        return ready[0]

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The committed training state, from rank 0 (tensors on the CPU, metadata)."""
        self.commit_all()
        head = self.members[0]
        result: tuple[dict[str, torch.Tensor], dict[str, Any]] = self.calls.gather(
            {head.name: head.actor.get_state.remote(self.gen)}, deadline_s=300, step=None
        )[head.name]
        return result

    def commit_all(self) -> None:
        """Makes every worker apply the committed steps now (before a snapshot or the end)."""
        points.hit("membership.commit_all", membership=self)
        log = self.commit_log
        refs = {
            h.name: h.actor.commit.remote(self.gen, log.steps_done, skipped=log.last_skipped)
            for h in self.members
        }
        self.calls.gather(refs, deadline_s=self.deadline.seconds, step=None)

    # ---- waiting for workers -----------------------------------------------------------------

    def wait_for_replacements(
        self, *, timeout_s: float, done: Callable[[list[WorkerHandle]], bool],
        nothing_coming: Callable[[], bool], on_ready: Callable[[list[WorkerHandle]], None]
        | None = None, poll_s: float = 0.2,
    ) -> list[WorkerHandle]:
        """The one wait for workers that become ready: polls the pool until ``done(ready)``
        (``ready``: every worker ready so far), ``timeout_s`` passed, or ``nothing_coming()``
        while not done. ``on_ready`` takes each batch as it comes (a join at a boundary);
        returns every worker that became ready."""
        ready: list[WorkerHandle] = []
        end = time.monotonic() + timeout_s
        while not done(ready) and time.monotonic() < end:
            got = self.pool.poll(timeout_s=min(poll_s, max(0.0, end - time.monotonic())))
            ready += got
            if got and on_ready is not None:
                on_ready(got)
            if not done(ready) and nothing_coming():
                break
        return ready

    def wait_ready(self, count: int, *, timeout_s: float) -> list[WorkerHandle]:
        """Up to ``count`` workers started by the pool, once ready (fewer past ``timeout_s``
        or when no start is pending)."""
        return self.wait_for_replacements(
            timeout_s=timeout_s, done=lambda ready: len(ready) >= count,
            nothing_coming=lambda: not self.pool.pending_count, poll_s=0.5)

    def wait_for_width(self, width: int, *, timeout_s: float,
                       admit: Callable[[list[WorkerHandle]], None]) -> int:
        """Waits at a step boundary, admitting replacements (``admit``) as they become ready,
        until ``width`` replicas are live or ``timeout_s`` has passed; returns the width."""
        self.wait_for_replacements(
            timeout_s=timeout_s, done=lambda _: self.width >= width,
            nothing_coming=lambda: self.pool.pending_count == 0, on_ready=admit)
        return self.width

    def wait_for_spares(self, *, timeout_s: float,
                        admit: Callable[[list[WorkerHandle]], None]) -> int:
        """Waits until ``config.spares`` standby workers are warm or ``timeout_s`` has passed
        (a replacement that becomes ready meanwhile joins through ``admit``); returns how many
        stand by."""
        spares = self.config.spares
        self.wait_for_replacements(
            timeout_s=timeout_s, done=lambda _: len(self.pool.standby) >= spares,
            nothing_coming=lambda: not self.pool.spares_starting, on_ready=admit)
        return len(self.pool.standby)

    def check_same_init(self, handles: list[WorkerHandle]) -> None:
        """The workers built the same initial parameters and the same dataset, or this raises."""
        setups = {h.name: h.info for h in handles if h.info is not None}
        sums = {name: s.checksum for name, s in setups.items()}
        if len(set(sums.values())) > 1:
            raise ElasticRuntimeError(
                f"replicas built different initial parameters {sums}: make the model factory "
                "deterministic (it runs with torch seeded from spec.seed)"
            )
        problem = describe_mismatch({name: s.data_fingerprint for name, s in setups.items()})
        if problem is not None:
            self.log.emit("data_mismatch", workers=[h.name for h in handles], reason=problem)
            raise DataMismatch(
                f"workers built different datasets ({problem}): make the dataset factory "
                "deterministic (it runs with random, numpy and torch seeded from spec.seed; "
                "seed anything else from spec.seed, not from the process, host or clock) "
                "and read the same files on every node"
            )
