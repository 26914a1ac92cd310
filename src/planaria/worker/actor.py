"""The worker actor: one replica of the model, driven by the controller.

A worker never decides anything: it runs steps when told, and applies a step only
when its reduction completed (invariant 1). Every call carries the generation; an
older one is refused (invariant 3). The actor is a thin shell of remote methods
over the parts that do the work:

- :class:`~planaria.worker.membership.Membership`: generation, group, fence, abort;
- :class:`~planaria.worker.vitals.Vitals`: phase, progress, heartbeat;
- :class:`~planaria.worker.replica_state.ReplicaState`: model, optimizer, scheduler,
  buffers, loss scaler, and the gradient's :class:`~planaria.worker.reduce.Reducer`;
- :class:`~planaria.worker.commit.Commits`: the pending step applied or dropped;
- :class:`~planaria.worker.loader.SampleLoader`: the samples of this worker's share;
- :class:`~planaria.worker.engine.StepEngine`: one step's forward, backward, reduce;
- :class:`~planaria.worker.run_loop.RunLoop`: runs of steps between boundaries;
- :class:`~planaria.worker.evaluation.Evaluator`: its batches of an evaluation;
- :class:`~planaria.worker.transfer.StateTransfer`: the state sent to a joiner;
- :mod:`~planaria.worker.ckpt_save` and :mod:`~planaria.worker.ckpt_restore`: checkpoints.

Each remote method answers a report of :mod:`planaria.wire.reports` or
:mod:`planaria.wire.state_reports` (a frozen dataclass, or a count), which a sharded
replica's leader merges with its other workers' (:func:`~planaria.worker.replica.fans_out`).
Tests inject faults at its named fault points (:meth:`Worker.arm_fault`, faults.points).
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from planaria.config import TrainSpec
from planaria.faults.points import WORKER_POINTS, FaultPoints
from planaria.wire import lifeline, reports, store_keys
from planaria.wire.evaluation import EvalReport
from planaria.wire.probes import LinkReport, ProbeServer
from planaria.wire.reports import Hold, Joined, RunReport, Settled, merge_checksums, merge_sum
from planaria.wire.state_reports import (
    RestoreRead,
    Setup,
    ShardWritten,
    Snapshot,
    StateMeta,
    StorageProbe,
    merge_written,
)
from planaria.wire.takeover import Lease, WorkerReport
from planaria.wire.worker_markers import register_worker
from planaria.worker import compile_cache as compile_cache_mod
from planaria.worker import forkserver, process
from planaria.worker.ckpt_restore import CheckpointRestorer
from planaria.worker.ckpt_save import CheckpointSaver, SaveOptions, probe_storage
from planaria.worker.collective import connect_store
from planaria.worker.commit import Commits
from planaria.worker.engine import StepEngine
from planaria.worker.evaluation import Evaluator
from planaria.worker.key_watch import KeyWatch
from planaria.worker.loader import SampleLoader
from planaria.worker.low_priority import lowered_here, run_at_priority, thread_priority
from planaria.worker.membership import Membership
from planaria.worker.replica import fans_out, lane, start_followers
from planaria.worker.replica_state import ReplicaShape, ReplicaState
from planaria.worker.run_loop import RunLoop
from planaria.worker.transfer import StateTransfer
from planaria.worker.vitals import Vitals

__all__ = ["CONCURRENCY_GROUPS", "Worker"]

CONCURRENCY_GROUPS = {"control": 1, "ckpt": 2, "transfer": 1}
"""A worker actor's lanes beside the default one (steps, state): ``control`` for calls that
must answer mid-step (abort, alive, stack dumps), ``ckpt`` for the wait on a checkpoint
write (``ckpt_wait``), ``transfer`` for the wait on a state received beside the steps."""


class Worker:
    """A replica. Created by the controller as a Ray actor (see ``planaria.control.pool``)."""

    def __init__(
        self,
        name: str,
        spec: TrainSpec | bytes,
        store_host: str,
        store_port: int,
        *,
        threads: int,
        heartbeat_s: float,
        use_gpu: bool = False,
        backend: str | None = None,
        record_digests: bool = False,
        overlap_reduction: bool = False,
        keep_finished: bool = True,
        prefetch: bool | None = None,
        loader_workers: int = 0,
        workers_per_replica: int = 1,
        shard_index: int = 0,
        replica_key: str | None = None,
        follower_options: dict[str, Any] | None = None,
        timeouts: tuple[float, float] = (60.0, 300.0),
        spec_blob: bytes | None = None,
    ) -> None:
        self.init_t, self.init_cpu_s = time.time(), time.process_time()  # (CPU: since a fork)
        self.start_priority = forkserver.end_low_priority_start()  # a joiner's: SCHED_IDLE so far
        self.name = name
        # A sharded replica (planaria.worker.sharded): k workers, this one holding shard_index.
        self.k, self.shard_index = workers_per_replica, shard_index
        self.replica_key = replica_key or name
        self.spec: TrainSpec = ray.cloudpickle.loads(spec) if isinstance(spec, bytes) else spec
        torch.set_num_threads(threads)
        process.keep_freed_memory()
        device = torch.device("cuda") if use_gpu else torch.device("cpu")
        self.backend = backend or ("nccl" if use_gpu else "gloo")
        if self.backend == "nccl":
            process.nccl_survives_errors()
        self.faults = FaultPoints(WORKER_POINTS, worker=self)
        connect = functools.partial(connect_store, store_host, store_port, timeout_s=30)
        self.vitals = Vitals(name, lambda: self.membership.gen, heartbeat_s,
                             cpu=device.type == "cpu")
        # Preemption notice: a node drain or spot reclaim sends SIGTERM; drain at the boundary.
        signal.signal(signal.SIGTERM, lambda signum, frame: self.vitals.notice_preemption())
        # The node's own SIGTERM reaches the node's first process, not this one: a marker lets
        # `planaria node-drain-hook` find this worker and forward it (see planaria.control.drain).
        self.ray_node = process.ray_node_id()
        register_worker(name, node_id=self.ray_node, gcs_address=process.gcs_address())
        self.store = connect()
        if shard_index == 0 and self.store.check([store_keys.lifelines()]):
            # Held for the life of the process: the controller knows its end at once.
            lifeline.hold(self.store.get(store_keys.lifelines()).decode(), name)
        self.membership = Membership(name, self.store, sharded=self.k > 1)
        shape = ReplicaShape(k=self.k, shard_index=shard_index, replica_key=self.replica_key,
                             backend=self.backend, timeout_s=timeouts[1],
                             overlap_reduction=overlap_reduction, keep_finished=keep_finished)
        self.state = ReplicaState(self.spec, device, shape, self.store)
        self.commits = Commits(name, self.state, self.membership, self.vitals)
        self.loader = SampleLoader(name, self.spec, device, self.vitals, k=self.k,
                                   shard_index=shard_index, threads=threads, prefetch=prefetch,
                                   record_digests=record_digests, processes=loader_workers)
        self.engine = StepEngine(name, self.state, self.commits, self.loader, self.membership,
                                 self.vitals, self.faults)
        # A run's stop key is polled off the training thread, by rank 0 alone (key_watch).
        self.keys = KeyWatch(connect)
        self.loop = RunLoop(name, self.engine, self.commits, self.membership, self.vitals,
                            self.keys, self.faults, leads=shard_index == 0)
        self.evaluator = Evaluator(name, self.state, self.commits, self.membership, self.vitals,
                                   self.faults, lambda: self.loader.collate)
        self.transfer = StateTransfer(name, self.state, self.commits, self.membership,
                                      self.vitals, self.faults)
        self.saver = CheckpointSaver(name, self.state, self.commits, self.vitals, self.faults)
        self.restorer = CheckpointRestorer(name, self.state, self.commits, self.loader,
                                           self.membership, self.vitals)
        self.compile_dir: Path | None = None
        # Answers the controller's and its peers' probes on the address its group uses
        # (planaria.control.links: who cannot be reached when every rank waits on its peers).
        self.probe = ProbeServer(process.group_address())
        self.store.set(store_keys.probe(name), self.probe.address)
        self.vitals.start(self.store, connect)
        # A sharded replica's leader owns its other workers: they die with it.
        self.followers: list[Any] = [] if self.k == 1 or shard_index else start_followers(
            Worker, CONCURRENCY_GROUPS, name, self.k,
            spec_blob if spec_blob is not None else ray.cloudpickle.dumps(spec),
            follower_options, store_host, store_port, threads=threads, heartbeat_s=heartbeat_s,
            use_gpu=use_gpu, backend=backend, record_digests=record_digests, prefetch=prefetch,
            loader_workers=loader_workers, workers_per_replica=self.k,
            replica_key=self.replica_key, timeouts=timeouts)

    @ray.method(concurrency_group="control")
    def arm_fault(self, point: str, action: Callable[..., Any] | None, *,
                  times: int | None = None, shard: int = 0) -> None:
        """Arms this worker's fault ``point`` (:data:`~planaria.faults.points.WORKER_POINTS`)
        with ``action``, called there with ``worker`` (this actor) and ``step``; None
        disarms it. ``shard``: the replica's worker to arm (0: this one; i: its i-th)."""
        if shard:
            ray.get(self.followers[shard - 1].arm_fault.remote(point, action, times=times))
        elif action is None:
            self.faults.disarm(point)
        else:
            self.faults.arm(point, action, times=times)

    # ---- lifecycle -------------------------------------------------------------------------

    @fans_out(Setup.merge)
    def setup(self, *, joiner: bool = False, skip_init: bool = False, priority: str = "worker",
              compile_cache: bytes | None = None, reserve: str | None = None) -> Setup:
        """Builds model (``skip_init``: its weights not drawn, worker.skip_init), optimizer,
        scheduler and dataset from the spec's factories; off the critical path a joiner (a
        replacement, a spare) runs a forward and backward (``StepEngine.warm_up``: compiles
        with ``spec.compile``, from ``compile_cache``) and makes its optimizer state (in shared
        memory with ``reserve``, worker.memory_reserve); its checksum is 0 (it is sent its
        state). All three at CPU ``priority`` (planaria.worker.low_priority)."""
        self.vitals.phase, t0 = "setup", time.time()
        num_samples, fingerprint = self.loader.setup()  # its processes at the worker's priority
        data_s = time.time() - t0
        start = run_at_priority(lambda: self._build(joiner, skip_init, compile_cache, reserve),
                                priority)
        warm_s, t1, warm_priority = 0.0, time.time(), "worker"
        if self.spec.compile or joiner:  # on the steps' thread: its allocator's memory is theirs
            with lowered_here(priority, may_raise=forkserver.may_raise_priority()) as lowered:
                self.engine.warm_up(joiner=joiner)
                warm_s, warm_priority = time.time() - t1, lowered
        self.vitals.phase = "idle"
        return Setup(
            pid=os.getpid(), node=socket.gethostname(), ray_node=self.ray_node,
            init_t=self.init_t, start={
                **start, "data_s": data_s, "warm_s": warm_s, "setup_s": time.time() - t0,
                "compile_s": warm_s if self.spec.compile else 0.0, "warm_priority": warm_priority,
                "forked": forkserver.forked(), "start_priority": self.start_priority,
                "process_cpu_s": self.init_cpu_s, "init": "skipped" if skip_init else "drawn",
                "setup_cpu_s": time.process_time() - self.init_cpu_s,
                "start_group": forkserver.end_low_priority_setup()},  # back to nice 0 here
            checksum=0 if joiner else self.state.checksum(), param_bytes=self.state.nbytes(),
            num_samples=num_samples, data_fingerprint=fingerprint,
            dataset_draws=sorted(self.loader.global_draws),
        )

    def _build(self, joiner: bool, skip_init: bool, compile_cache: bytes | None,
               reserve: str | None) -> dict[str, float | str]:
        t0 = time.time()
        if self.spec.compile:
            self.compile_dir = compile_cache_mod.use_private_cache(compile_cache)
        self.state.build(skip_init=skip_init)
        t1 = time.time()
        region = self.commits.place_optimizer_state(reserve, joiner=joiner)
        return {"build_s": t1 - t0, "prebuild_s": time.time() - t1 if joiner else 0.0,
                "priority": thread_priority(), "reserve": region or "none"}

    def compile_cache(self) -> bytes | None:
        """This worker's compile cache, packed (None without ``spec.compile``)."""
        if not self.spec.compile or self.compile_dir is None:
            return None
        return compile_cache_mod.pack(self.compile_dir)

    @fans_out(merge_checksums)
    def reinit(self, gen: int) -> int:
        """Back to the initial state (after a restore that failed part-way); returns checksum."""
        self.membership.check(gen)
        self.state.build()
        self.commits.reset()
        self.state.dirty = False
        return self.state.checksum()

    @fans_out(Joined.merge)
    def join(
        self, gen: int, rank: int, world_size: int, steps_done: int,
        timeouts: tuple[float, float], next_ids: np.ndarray | None = None, *,
        skipped: int = -1, skip: tuple[int, ...] | None = None, lease: Lease | None = None,
    ) -> Joined:
        """Enters generation ``gen``: settles the pending step, builds the new group.

        A worker with no state yet (a replacement) may be behind ``steps_done``;
        the controller sends it the state next and checks survivors are not behind.
        ``next_ids`` (this rank's share of the next step) start loading at once.
        Reports what a step attempt dropped here had been served (``dropped``),
        for the ledger. ``skip``: the samples the job skips (see WorkFault), from now on.
        ``lease``: the controller's (a join under an older epoch than the newest is refused).
        """
        self.membership.enter(gen, lease=lease)
        commits, pending = self.commits, self.commits.pending
        commits.settle(steps_done, skipped, allow_behind=True)
        attempt, self.engine.last_attempt = self.engine.last_attempt, None
        dropped = attempt if (attempt and attempt.step == pending
                              and commits.steps_done <= attempt.step) else None
        self.loader.on_join(next_ids, steps_done, world_size, rank, skip)
        self.membership.close()
        self.vitals.set_phase("joining", commits.steps_done)
        self.membership.join(gen, rank, world_size, backend=self.backend, timeouts=timeouts,
                             shard_index=self.shard_index)
        self.vitals.phase = "idle"
        return Joined(steps_done=commits.steps_done, dropped=dropped)

    @fans_out()
    def shutdown(self) -> None:
        self.vitals.stop()
        self.probe.close()
        self.keys.close()
        self.membership.close()
        self.loader.close()

    # ---- steps ---------------------------------------------------------------------------------

    @fans_out(RunReport.merge)
    def run(
        self, gen: int, run_id: int, start: int, until: int, *, plan: tuple[int, int, int],
        skipped: int = -1, ledger: bool = False, metric_keys: tuple[str, ...] = (),
        horizon: int | None = None, carry: reports.CarriedStep | None = None,
    ) -> RunReport | reports.RunFailed:
        """Runs steps ``start`` .. ``until - 1`` on its own (:meth:`RunLoop.run
        <planaria.worker.run_loop.RunLoop.run>`)."""
        return self.loop.run(gen, run_id, start, until, plan=plan, skipped=skipped, ledger=ledger,
                             metric_keys=metric_keys, horizon=horizon, carry=carry)

    @fans_out(Settled.merge)
    def settle_run(self, gen: int) -> Settled:
        """After a failed run: drops a step whose collective did not complete here, and
        reports how far this worker got and the records of the steps it applied."""
        return self.loop.settle(gen)

    @fans_out()
    def commit(self, gen: int, steps_done: int, *, skipped: int = -1) -> int:
        """Applies the pending step if the controller counts it committed; returns steps done."""
        self.membership.check(gen)
        self.commits.settle(steps_done, skipped)
        self.vitals.set_phase("idle", self.commits.steps_done)  # not "apply": the call is over
        return self.commits.steps_done

    @fans_out(EvalReport.merge)
    def evaluate(self, gen: int, step: int, place: int, width: int) -> EvalReport:
        """This replica's eval batches after ``step`` steps: place ``place`` of ``width``'s."""
        self.membership.check(gen)
        return self.evaluator.run(step, place, width)

    # ---- state: hot-join -----------------------------------------------------------------------

    @fans_out(StateMeta.merge)
    def state_meta(self, gen: int, beside: bool = False) -> StateMeta:
        """What a joiner needs besides tensors (``beside``: see planaria.worker.transfer)."""
        self.membership.check(gen)
        return self.transfer.meta(beside=beside)

    @fans_out(merge_sum)
    def send_state(self, gen: int, dsts: list[int], beside: bool = False) -> int:
        """Sends the state to ranks ``dsts`` (``beside``: from a thread, at once); its bytes."""
        self.membership.check(gen)
        return self.transfer.send(dsts, beside=beside)

    @fans_out(merge_sum)
    def recv_state(self, gen: int, src: int, source: StateMeta) -> int:
        """Receives rank ``src``'s state into the live tensors (a sharded worker: its part)."""
        self.membership.check(gen)
        return self.transfer.receive(src, source.part(self.shard_index))

    @ray.method(concurrency_group="transfer")
    def state_received(self, gen: int, timeout_s: float) -> tuple[float, list[str]]:
        """The rest of a state received beside the steps: its seconds and routes (or error)."""
        self.membership.check(gen)
        return self.transfer.wait_received(timeout_s)

    @fans_out()
    def get_state(self, gen: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Copies of the whole state and its metadata (a sharded replica's leader: whole)."""
        self.membership.check(gen)
        return self.state.copies(self.commits.steps_done)

    @fans_out(merge_checksums)
    def checksum(self, gen: int) -> int:
        self.membership.check(gen)
        return self.state.checksum()

    # ---- checkpoints (planaria.checkpoint.coordinator's Checkpointer calls these) --------------

    @fans_out(Snapshot.merge)
    def ckpt_start(
        self, gen: int, step: int, index: int, num_shards: int, save_id: str, root: str,
        storage_options: Mapping[str, Any] | None = None, *, fsync: bool = True,
        attempts: int = 3, staging_budget_bytes: int | None = None, direct_io: bool = True,
        copy_beside: bool = True, describe: dict[str, Any] | None = None,
    ) -> Snapshot:
        """Snapshots shard ``index`` of ``num_shards`` of the settled state after ``step``
        steps and starts writing it under ``root`` (:meth:`CheckpointSaver.start
        <planaria.worker.ckpt_save.CheckpointSaver.start>`; ``copy_beside``: the copy into
        staging runs beside the next step). ``describe`` (writer 0's: the save's
        description) is written beside the shards, with this worker's metadata."""
        self.membership.check(gen)
        return self.saver.start(step, index, num_shards, save_id, SaveOptions(
            root=root, storage_options=storage_options, fsync=fsync, attempts=attempts,
            staging_budget_bytes=staging_budget_bytes, direct_io=direct_io,
            copy_beside=copy_beside), describe)

    @fans_out(Hold.merge)
    @lane("ckpt")
    def ckpt_freeze(self, gen: int) -> Hold:
        """Beside the steps: no step from now on is applied (a hold) until ckpt_advance or
        ckpt_release; returns the steps done.
        The training thread goes on computing and waits, before its next apply, in phase
        ``held``; an abort of the generation drops the held step."""
        self.membership.check(gen)
        return self.commits.freeze()

    @fans_out(Hold.merge)
    @lane("ckpt")
    def ckpt_advance(self, gen: int, to: int, timeout_s: float) -> Hold:
        """Under a hold: lets the steps before ``to`` be applied, and waits (bounded) until
        they are: every replica then holds step ``to``'s state. Returns the steps done."""
        self.membership.check(gen)
        return self.commits.advance(to, timeout_s)

    @fans_out()
    @lane("ckpt")
    def ckpt_release(self, gen: int) -> None:
        """Ends a hold: the training thread applies its steps again."""
        self.commits.release()

    @fans_out(Snapshot.merge)
    @lane("ckpt")
    def ckpt_start_beside(
        self, gen: int, step: int, index: int, num_shards: int, save_id: str, root: str,
        storage_options: Mapping[str, Any] | None = None, *, fsync: bool = True,
        attempts: int = 3, staging_budget_bytes: int | None = None, direct_io: bool = True,
        describe: dict[str, Any] | None = None,
    ) -> Snapshot:
        """As :meth:`ckpt_start`, but beside the steps, under a hold (:meth:`ckpt_freeze`)."""
        self.membership.check(gen)
        return self.saver.start_beside(step, index, num_shards, save_id, SaveOptions(
            root=root, storage_options=storage_options, fsync=fsync, attempts=attempts,
            staging_budget_bytes=staging_budget_bytes, direct_io=direct_io), describe)

    @fans_out(merge_written)
    def ckpt_poll(self, save_id: str) -> ShardWritten | None:
        """The shard record of save ``save_id`` once written (None while writing). Not fenced
        by generation: it only reads what this worker's writer did, and the controller
        matches records to the save by ``save_id``."""
        return self.saver.poll(save_id)

    @fans_out(merge_written)
    @lane("ckpt")
    def ckpt_wait(self, save_id: str, timeout_s: float) -> ShardWritten:
        """Waits, beside the steps (its own concurrency group), until this worker's shard of
        save ``save_id`` is written and read back, and returns its record: the controller
        commits the save the moment the last writer's answer arrives."""
        return self.saver.wait(save_id, timeout_s)

    @fans_out(StorageProbe.merge)
    def ckpt_probe(
        self, root: str, name: str, storage_options: Mapping[str, Any] | None, size: int
    ) -> StorageProbe:
        """Reads the file ``name`` the controller wrote under ``root``. Not fenced: it reads."""
        return probe_storage(root, name, storage_options, size)

    @fans_out(RestoreRead.merge)
    def ckpt_read(
        self, gen: int, path: str, names: list[str] | None,
        storage_options: Mapping[str, Any] | None = None, *, strict: bool = True,
    ) -> RestoreRead:
        """Phase 1 of a restore (:meth:`CheckpointRestorer.read
        <planaria.worker.ckpt_restore.CheckpointRestorer.read>`)."""
        self.membership.check(gen)
        return self.restorer.read(path, names, storage_options, strict=strict)

    @fans_out(merge_checksums)
    def ckpt_apply(
        self, gen: int, path: str, owners: dict[str, int] | None = None
    ) -> int:
        """Phase 2 of a restore (:meth:`CheckpointRestorer.apply
        <planaria.worker.ckpt_restore.CheckpointRestorer.apply>`); returns the checksum."""
        self.membership.check(gen)
        return self.restorer.apply(path, owners)

    # ---- beside the steps: abort, liveness, diagnostics ----------------------------------------

    @ray.method(concurrency_group="control")
    def abort(self, gen: int) -> None:
        """A peer of generation ``gen`` failed: abandon its step between micro-batches.

        The controller's call, run beside the step (the control concurrency group), so
        no worker polls for it: nothing per step, nothing per second. A collective of that
        generation in progress is interrupted: a survivor does not wait on the transport to
        notice the dead peer."""
        self.membership.abort(gen)
        for follower in self.followers:  # no answer awaited: the replica's abandon together
            follower.abort.remote(gen)

    @ray.method(concurrency_group="control")
    def probe_links(self, peers: dict[str, str], timeout_s: float) -> LinkReport:
        """Beside the step: which of ``peers`` (name → probe address) answer, and this
        process's TCP connections whose bytes go unacked (planaria.control.links)."""
        return process.probe_peers(peers, timeout_s)

    @ray.method(concurrency_group="control")
    @fans_out()
    def alive(self) -> bool:
        """Answers at once, beside any step (a sharded replica's workers all answer): the
        controller's question after a peer's death, and before an idle standby spare takes
        a place."""
        return True

    @ray.method(concurrency_group="control")
    def dump_stack(self) -> str:
        """Every thread's Python stack (answers even while a step is running)."""
        return process.thread_stacks()

    @fans_out(WorkerReport.merged)
    @lane("control")
    def describe(self) -> WorkerReport:
        """What a controller taking this worker over needs (planaria.control.takeover):
        generation, rank, steps done, the pending step, whether its state is whole, the
        lease it was told. Beside any step, and cheap: no checksum of the weights."""
        comm = self.membership.comm
        return WorkerReport(
            name=self.name, workers=1, gen=self.membership.gen,
            rank=comm.rank if comm is not None else None,
            steps_done=self.commits.steps_done, pending=self.commits.pending,
            intact=not self.state.dirty, lease=self.membership.lease,
            skipped_samples=tuple(sorted(self.loader.skipped_samples)))
