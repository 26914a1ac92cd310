"""The worker actor: one replica of the model, driven by the controller.

A worker never decides anything: it computes a step when told, keeps the
reduced gradient pending, and applies it only when a later call from the
controller says the step was committed (invariant 1). Every call carries the
generation; an older one is refused (invariant 3). A heartbeat thread reports
the worker's phase to the controller's store, and makes a fenced-off worker
(a zombie that woke up after it was evicted) exit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import ray
import torch

from planaria import compile_cache as compile_cache_mod
from planaria import forkserver, store_keys
from planaria.buffers import BufferSync
from planaria.busy import BusyProbe, current_thread_ids
from planaria.collective import Collective, connect_store
from planaria.config import TrainSpec
from planaria.data_plan import micro_batch_range
from planaria.drain import live_workers, register_worker
from planaria.errors import (
    Failure,
    PlanariaError,
    StaleGeneration,
    StepAborted,
    UserCodeError,
    Work,
)
from planaria.faults import user_call
from planaria.integrity import Served, dataset_fingerprint
from planaria.key_watch import KeyWatch
from planaria.links import ProbeServer, local_endpoints, probe, stalled_connections
from planaria.liveness import Heartbeat, beat, quiet_s
from planaria.overlap import OverlappedReduce
from planaria.randomness import (
    factory_seed,
    micro_batch_seed,
    probe_sample,
    seed_globals,
    seed_torch,
    serve_samples,
)
from planaria.replica import (
    fans_out,
    merge_checksums,
    merge_join,
    merge_meta,
    merge_setup,
    merge_sum,
    replica_failed,
)
from planaria.sharded import ShardedReduce, init_replica_group, local, shard_model
from planaria.state import flatten_state, load_state, model_checksum, tensor_layout
from planaria.worker_checkpoint import CheckpointWorkerMixin
from planaria.worker_loop import WorkerLoopMixin

__all__ = ["Worker"]

_log = logging.getLogger("planaria.worker")
T = TypeVar("T")
SMALL_TENSOR_BYTES = 1 << 20  # tensors below this travel coalesced in one buffer per dtype


CONCURRENCY_GROUPS = {"control": 1, "ckpt": 2}
"""A worker actor's lanes beside the default one (steps, state): ``control`` for calls that
must answer mid-step (abort, alive, stack dumps), ``ckpt`` for the wait on a checkpoint
write (planaria.worker_checkpoint.ckpt_wait), which may last as long as the write."""

STATUS_TAIL = 32
"""Slots after the first fp32/fp64 gradient buffer that carry the autonomous loop's status
(:data:`planaria.worker_loop.STATUS` and the metrics' sums) in the gradient's all-reduce; a
longer status, or a model with no such buffer, is reduced on its own, in fp64 (see
:func:`status_in_tail`)."""
_TAIL_DTYPES = (torch.float32, torch.float64)
FP32_EXACT_COUNT = 2**24
"""fp32 holds every integer up to 2**24 exactly, and not 2**24 + 1."""


def status_in_tail(tail: torch.Tensor | None, status_len: int, global_batch_size: int) -> bool:
    """Whether a step's status may ride in the gradient buffer's ``tail`` (its dtype: the
    gradient's): it must fit, and its sample count must stay exact. Every partial sum of
    the ranks' counts is at most the global batch, so an fp32 tail is exact for a global
    batch below 2**24; a larger one sends the status beside the gradient, in fp64 (exact
    to 2**53). Loss and metric sums in an fp32 tail are good to ~1e-7 relative."""
    if tail is None or status_len > len(tail):
        return False
    return tail.dtype == torch.float64 or global_batch_size < FP32_EXACT_COUNT


def _factory(what: str, seed: int, fn: Callable[..., T], *args: Any) -> T:
    """A user factory, run with every global generator seeded from (spec seed, factory)."""
    seed_globals(factory_seed(seed, what))
    return user_call(f"the {what} factory", fn, *args)


@dataclass
class _Loaded:
    """A rank's share of a step, loaded: (samples, batch) per micro-batch, and what was served."""

    batches: list[tuple[int, Any]]
    served: Served


class Worker(CheckpointWorkerMixin, WorkerLoopMixin):
    """A replica. Created by the controller as a Ray actor (see ``planaria.workers``)."""

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
        prefetch: bool | None = None,
        workers_per_replica: int = 1,
        shard_index: int = 0,
        replica_key: str | None = None,
        follower_options: dict[str, Any] | None = None,
        timeouts: tuple[float, float] = (60.0, 300.0),
        spec_blob: bytes | None = None,
    ) -> None:
        self._init_t = time.time()  # after the process started and imported planaria
        self.name = name
        # A sharded replica (planaria.sharded): k workers, this one holding shard_index.
        self.k = workers_per_replica
        self.shard_index = shard_index
        self.replica_key = replica_key or name
        self._timeouts = timeouts
        self._sharded: ShardedReduce | None = None
        self.grad_buffers: list[torch.Tensor] = []  # see _bind_grad_buffers
        self._reduced: list[torch.Tensor] = []
        self._status_tail: torch.Tensor | None = None
        self.record_digests = record_digests
        self.overlap_reduction = overlap_reduction
        self._prefetch_setting = prefetch
        self._prefetch_on = bool(prefetch)  # decided at each join (see _want_prefetch)
        # The global generators dataset[i] draws from, found at setup (_fingerprint_sample):
        # if any, every sample is served with them seeded, on the training thread only.
        self._global_draws: set[str] = set()
        self._overlap: OverlappedReduce | None = None
        self.spec = ray.cloudpickle.loads(spec) if isinstance(spec, bytes) else spec
        self.threads = threads
        torch.set_num_threads(threads)
        self.device = torch.device("cuda") if use_gpu else torch.device("cpu")
        self.backend = backend or ("nccl" if use_gpu else "gloo")
        if self.backend == "nccl":
            _nccl_survives_errors()
        self.scaler: torch.amp.GradScaler | None = None  # fp16's loss scaler (_build_model)
        self.gen = -1
        self.comm: Collective | None = None
        self.steps_done = 0
        self.pending: int | None = None
        self.phase = "starting"
        self.phase_step = -1
        self._grad_norm = 0.0
        self.progress = 0  # bumped at every phase change and micro-batch: see planaria.liveness
        self._beat = 0
        self.preempting = False
        # A hold (planaria.worker_checkpoint's ckpt_freeze): while set, no step at or past
        # `_hold_below` is applied, so that a snapshot taken beside the training thread sees
        # the same committed step on every replica. The lock guards the committed state
        # against such a snapshot.
        self._state_lock = threading.RLock()
        self._hold = threading.Condition(self._state_lock)
        self._hold_below: int | None = None
        self._reduced_step = -1  # the newest step whose reduction completed here
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planaria-loader")
        self._prefetched: tuple[bytes, Future[_Loaded]] | None = None
        self._attempt: dict[str, Any] | None = None  # what the last step attempt was served
        # A run's stop key is polled off the training thread, by rank 0 alone (key_watch).
        self._keys = KeyWatch(lambda: connect_store(store_host, store_port, timeout_s=30))
        self._aborted_gen = -1  # the last generation the controller told to abort (abort())
        self._run_records: list[dict[str, Any]] = []  # the autonomous loop's (worker_loop)
        self._ledger_hook: tuple[int, int, int] | None = None
        self._status_metrics: tuple[str, ...] | None = None
        # The fault seam: called as loop_fault(worker, step, phase) once a step's samples are
        # loaded ("loaded"), once its gradient is computed ("computed", before the reduction)
        # and, in the autonomous loop, once it is reduced ("reduced", before it is applied)
        # and applied ("applied"): where tests inject faults between the phases.
        self.loop_fault: Callable[[Any, int, str], None] | None = None
        self._stop = threading.Event()
        self._wake_beat = threading.Event()  # a notice: the heartbeat thread tells at once
        self._committed_t = -math.inf  # when the autonomous run last applied a step
        # What the threads work on, for the heartbeat (planaria.liveness): the training
        # thread's micro-batch ("m<j>"), the loader's sample ("i<id>"), and the threads whose
        # CPU time and frames tell busy from hung (planaria.busy).
        self._work = ""
        self._loading = ""
        self._train_thread: tuple[int, int] | None = None
        self._loader_thread: tuple[int, int] | None = None
        self._busy = BusyProbe(self._working_threads, cpu=self.device.type == "cpu")
        self.skipped_samples: frozenset[int] = frozenset()  # never loaded (a work fault)
        self._quiet_s = quiet_s(heartbeat_s)
        # Preemption notice: a node drain or spot reclaim sends SIGTERM; drain at the boundary.
        signal.signal(signal.SIGTERM, self._on_sigterm)
        # The node's own SIGTERM reaches the node's first process, not this one: a marker lets
        # `planaria node-drain-hook` find this worker and forward it (see planaria.drain).
        self.ray_node = _ray_node_id()
        register_worker(name, node_id=self.ray_node, gcs_address=_gcs_address())
        self._store = connect_store(store_host, store_port, timeout_s=30)
        # Answers the controller's and its peers' probes on the address its group uses
        # (planaria.links: who cannot be reached when every rank waits on its peers).
        self._probe = ProbeServer(_group_address())
        self._store.set(store_keys.probe(name), self._probe.address)
        self._publish_heartbeat()
        threading.Thread(
            target=beat, name="planaria-heartbeat", daemon=True,
            args=(lambda: connect_store(store_host, store_port, timeout_s=30), name,
                  self._heartbeat_record, self._stop, heartbeat_s, self._quiet,
                  lambda: self.preempting, self._wake_beat),
        ).start()
        self._followers: list[Any] = []
        if self.k > 1 and shard_index == 0:
            # The replica's other workers: actors this one owns, so they die with it.
            remote: Any = ray.remote
            cls = remote(concurrency_groups=CONCURRENCY_GROUPS)(Worker)
            # The spec as the controller pickled it: its functions may live in a module only
            # the controller has (a script run by `planaria run`), pickled by value there.
            blob = spec_blob if spec_blob is not None else ray.cloudpickle.dumps(spec)
            self._followers = [
                cls.options(max_restarts=0, max_concurrency=1, **(follower_options or {})).remote(
                    f"{name}.{i}", blob, store_host, store_port, threads=threads,
                    heartbeat_s=heartbeat_s, use_gpu=use_gpu, backend=backend,
                    record_digests=record_digests, prefetch=prefetch,
                    workers_per_replica=self.k, shard_index=i, replica_key=self.replica_key,
                    timeouts=timeouts,
                )
                for i in range(1, self.k)
            ]

    # ---- lifecycle -------------------------------------------------------------------------

    @fans_out(merge_setup)
    def setup(
        self, *, prebuild_optimizer_state: bool = False, compile_cache: bytes | None = None
    ) -> dict[str, Any]:
        """Builds model, optimizer, scheduler and dataset from the spec's factories.

        A replacement (``prebuild_optimizer_state``) also materialises its
        optimizer state now, off the critical path, so that the state it will
        receive lands in memory that is already allocated and touched. With
        ``spec.compile`` the model is compiled here, from ``compile_cache`` (a
        running worker's, see :mod:`planaria.compile_cache`) when given.
        """
        self.phase = "setup"
        spec = self.spec
        t0 = time.time()
        if spec.compile:
            self._compile_dir = compile_cache_mod.use_private_cache()
            if compile_cache:
                compile_cache_mod.unpack(compile_cache, self._compile_dir)
        self._build_model()
        t1 = time.time()
        self.dataset = _factory("dataset", spec.seed, spec.dataset)
        if spec.collate is not None:
            self.collate = spec.collate
        else:
            from torch.utils.data import default_collate

            self.collate = default_collate
        num_samples = user_call("len(dataset)", len, self.dataset)
        self._global_draws = set()
        fingerprint = user_call(
            "dataset[i]", dataset_fingerprint, self.dataset, spec.seed, self._fingerprint_sample
        )
        t2 = time.time()
        if spec.compile:
            self._warm_compile()
        t3 = time.time()
        if prebuild_optimizer_state:
            self._prebuild_optimizer_state()
        self.phase = "idle"
        tensors, _ = flatten_state(self.model, self.optimizer, self.scheduler)
        return {
            "pid": os.getpid(),
            "node": socket.gethostname(),
            "ray_node": self.ray_node,
            "checksum": model_checksum(self.model),
            "num_samples": int(num_samples),
            "data_fingerprint": fingerprint,
            "dataset_draws": sorted(self._global_draws),
            "param_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "threads": torch.get_num_threads(),
            "init_t": self._init_t,
            "start": {"build_s": t1 - t0, "data_s": t2 - t1, "compile_s": t3 - t2,
                      "setup_s": time.time() - t0, "forked": forkserver.forked()},
        }

    def _warm_compile(self) -> None:
        """Compiles now, off the critical path: one forward and backward of a micro-batch of
        the dataset's first samples (the shape of every step's micro-batches), then the
        model's state and the gradients put back as they were."""
        mbs = self.spec.micro_batch_size
        n = user_call("len(dataset)", len, self.dataset)
        samples = [self._fingerprint_sample(i % n) for i in range(mbs)]
        batch = _to_device(user_call("collate", self.collate, samples), self.device)
        saved = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.model.train()
        torch.manual_seed(self.spec.seed)
        out = user_call("the loss function", self.spec.loss, self.compiled, batch)
        loss = out[0] if isinstance(out, tuple) else out
        user_call("backward", loss.backward)
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                v.copy_(saved[k])
        self._drop_pending()

    def compile_cache(self) -> bytes | None:
        """This worker's compile cache, packed (None without ``spec.compile``)."""
        if not self.spec.compile:
            return None
        return compile_cache_mod.pack(self._compile_dir)

    def _build_model(self) -> None:
        """Model, optimizer and scheduler in their initial state (seeded from the spec)."""
        spec = self.spec
        self.model = _factory("model", spec.seed, spec.model).to(self.device)
        if self.k > 1:
            self._shard_model()
        self.optimizer = _factory("optimizer", spec.seed, spec.optimizer, self.model.parameters())
        self.scheduler = (
            _factory("lr_scheduler", spec.seed, spec.lr_scheduler, self.optimizer)
            if spec.lr_scheduler
            else None
        )
        self.buffer_sync = BufferSync(self.model)
        self.scaler = (torch.amp.GradScaler(self.device.type)
                       if spec.precision == "fp16" else None)
        if self.k > 1:  # FSDP2 owns the gradients (sharded DTensors): no flat buffers
            self._sharded = ShardedReduce(list(self.model.parameters()), self.device)
            self.params = self._sharded.params
        else:
            self._bind_grad_buffers()
        self.compiled = (torch.compile(self.model, dynamic=False, **(spec.compile_options or {}))
                         if spec.compile else self.model)

    def _shard_model(self) -> None:
        """Shards the model over the replica's workers (planaria.sharded)."""
        params = {name for name, _ in self.model.named_parameters()}
        if any(name not in params for name in self.model.state_dict()):  # persistent buffers
            raise UserCodeError(
                "the model has buffers (BatchNorm running statistics, ...): sharded replicas "
                "(workers_per_replica > 1) do not keep buffers in step yet; use "
                "workers_per_replica=1, or a model without buffers (LayerNorm has none)"
            )
        init_replica_group(self._store, self.replica_key, self.shard_index, self.k,
                           self.backend, self._timeouts[1])
        self.model = shard_model(self.model, self.k, self.device, self.spec.shard)

    @fans_out(merge_checksums)
    def reinit(self, gen: int) -> int:
        """Back to the initial state (after a restore that failed part-way); returns checksum."""
        self._check(gen)
        self._build_model()
        self.pending = None
        self.steps_done = 0
        self.ckpt_dirty = False
        return model_checksum(self.model)

    def _prebuild_optimizer_state(self) -> None:
        """One optimizer step on zero gradients creates the state tensors (exp_avg, ...).

        It may move the parameters (weight decay): no matter, a replacement's
        parameters and optimizer state are all overwritten by the state it receives.
        """
        if self._sharded is not None:
            self._sharded.grads()  # zeros: an optimizer skips parameters with no gradient
        try:
            self.optimizer.step()
        except Exception:  # e.g. an optimizer that needs a closure: received into fresh memory
            _log.debug("%s could not pre-build optimizer state", self.name, exc_info=True)
        self._drop_pending()

    def _bind_grad_buffers(self) -> None:
        """Makes every parameter's .grad a view into one flat buffer per dtype.

        Backward accumulates straight into the buffers, which are then reduced
        whole: no copy in or out (what DDP calls gradient_as_bucket_view).
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.params = params
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        self.grad_buffers = []  # the gradients, one flat view per dtype
        self._reduced = []  # what the all-reduce sums: those and the tail
        self._status_tail = None
        for dtype, group in by_dtype.items():
            numel = sum(p.numel() for p in group)
            # The autonomous loop's status rides on the gradient's own all-reduce in a tail
            # of the first fp32/fp64 buffer: one collective a step, not two.
            tail = STATUS_TAIL if self._status_tail is None and dtype in _TAIL_DTYPES else 0
            flat = torch.zeros(numel + tail, dtype=dtype, device=self.device)
            offset = 0
            for p in group:
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self.grad_buffers.append(flat[:numel])
            self._reduced.append(flat)
            if tail:
                self._status_tail = flat[numel:]
        if self._overlap is not None:
            self._overlap.remove()
        self._overlap = (OverlappedReduce(self.grad_buffers, list(by_dtype.values()))
                         if self.overlap_reduction else None)

    @fans_out(merge_join)
    def join(
        self,
        gen: int,
        rank: int,
        world_size: int,
        steps_done: int,
        timeouts: tuple[float, float],
        next_ids: np.ndarray | None = None,
        *,
        skipped: int = -1,
        skip: tuple[int, ...] | None = None,
    ) -> dict[str, Any]:
        """Enters generation ``gen``: settles the pending step, builds the new group.

        A worker with no state yet (a replacement) may be behind ``steps_done``;
        the controller sends it the state next and checks survivors are not behind.
        ``next_ids`` (this rank's share of the next step) start loading at once.
        Reports what a step attempt dropped here had been served (``dropped``),
        for the ledger. ``skip``: the samples the job skips (see WorkFault), from now on.
        """
        self._enter(gen)
        pending = self.pending
        self._settle(steps_done, skipped, allow_behind=True)
        attempt, self._attempt = self._attempt, None
        dropped = (
            attempt
            if attempt and attempt["step"] == pending and self.steps_done <= attempt["step"]
            else None
        )
        self._prefetch_on = self._want_prefetch()
        if skip is not None:
            self.skipped_samples = frozenset(skip)
        if next_ids is not None and len(next_ids):
            total = self.spec.global_batch_size // self.spec.micro_batch_size
            self._prefetch(next_ids, steps_done, micro_batch_range(total, world_size, rank)[0])
        if self.comm is not None:
            self.comm.close()
            self.comm = None
        self._set_phase("joining", self.steps_done)
        self.comm = Collective(
            self._store,
            gen,
            rank,
            world_size,
            backend=self.backend,
            join_timeout_s=timeouts[0],
            timeout_s=timeouts[1],
            tag=f"s{self.shard_index}/" if self.shard_index else "",  # shard index's group
        )
        self.phase = "idle"
        return {"steps_done": self.steps_done, "dropped": dropped}

    @fans_out()
    def shutdown(self) -> None:
        self._stop.set()
        self._wake_beat.set()
        self._probe.close()
        self._keys.close()
        if self.comm is not None:
            self.comm.close()
        self._loader.shutdown(wait=False, cancel_futures=True)

    # ---- the step ----------------------------------------------------------------------------

    def _step(
        self,
        gen: int,
        step: int,
        ids: np.ndarray,
        steps_done: int,
        next_ids: np.ndarray | None = None,
        *,
        skipped: int = -1,
        status: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """Computes step ``step`` on ``ids`` and reduces the gradient; applies nothing yet.

        ``steps_done`` is the run's count of committed steps: if this worker's pending
        step is among them it is applied first, otherwise it is dropped; ``skipped`` is
        the newest step whose update the controller dropped (a non-finite one): it counts
        as done. ``status`` (see :mod:`planaria.worker_loop`) is summed over the ranks in
        the gradient's own all-reduce, in place. ``next_ids`` (this rank's share of the
        next step) load on the loader thread, or on this one while the reduction is in
        flight.

        A run (:meth:`run <planaria.worker_loop.WorkerLoopMixin.run>`) calls it each step:
        it checks its call's generation and fence once, not each step.
        """
        self._refuse_if_dirty("step")
        self._train_thread = current_thread_ids()
        self._settle(steps_done, skipped)
        if step != self.steps_done:
            raise PlanariaError(f"{self.name} asked for step {step} but has {self.steps_done} done")
        # From here the gradient buffers hold this step's (maybe partial) gradient: if the
        # step fails anywhere, the next settle drops it rather than apply or accumulate it.
        self.pending = step
        first, count, ids, rounds = self._own_share(ids)
        t0 = time.perf_counter()
        loss_sum = 0.0
        metric_sums: dict[str, float] = {}
        gbs = self.spec.global_batch_size
        assert self.comm is not None, "step before join"
        overlap = self._overlap if self.comm.world_size > 1 else None
        if self._overlap is not None:
            self._overlap.abandon()  # a step starts with no reduction armed (a failed one may)
        try:
            self._set_phase("loading", step)
            try:
                loaded = self._take(ids, step, first)
            except Failure as err:
                if self._sharded is not None:  # the replica's others learn it: all leave whole
                    self._sharded.agree_loaded(False)
                    err.replica_intact = True  # type: ignore[attr-defined]
                raise
            if self._sharded is not None:
                self._sharded.agree_loaded(True)
            served = loaded.served
            if self.loop_fault is not None:
                self.loop_fault(self, step, "loaded")  # a fault injected before the compute
            self._attempt = {"gen": gen, "step": step, "ids": served.ids, "digests": served.digests}
            self._record_served(step)  # the autonomous loop's ledger, before the collective
            data_wait_s = time.perf_counter() - t0
            ahead: np.ndarray | None = None  # the next step's share, loaded during the reduce
            if next_ids is not None and len(next_ids):
                ahead = self._own_share(next_ids)[2]
                if self._prefetch_on:
                    self._prefetch(ahead, step + 1, first)
                    ahead = None
            self._set_phase("compute", step)
            with self._state_lock:  # the committed buffers, kept as a snapshot beside reads them
                self.buffer_sync.begin()  # buffers are pending: put back unless the step commits
            self.model.train()
            # A sharded replica's workers run as many forwards as each other (FSDP's
            # collectives pair them): one with fewer micro-batches pads with a weightless one.
            real = [b for _, b in loaded.batches if b is not None]
            padding = [(0, real[0] if real else None)] * (rounds - len(loaded.batches))
            for j, (n, batch) in enumerate(loaded.batches + padding):
                self._raise_if_aborted(step)
                if overlap is not None and j == len(loaded.batches) - 1:
                    overlap.arm(self.comm)  # this backward reduces its buckets as they complete
                if batch is None:  # every sample of it skipped (a work fault): no forward,
                    if self._sharded is None or not real:  # or (FSDP pairs the replica's
                        self.progress += 1  # forwards) a weightless one
                        continue
                    batch = real[0]
                self._work = f"m{first + j}"
                # The micro-batch's own random stream: the same at any width, on any rank.
                seed_torch(micro_batch_seed(self.spec.seed, step, first + j))
                try:
                    with self._autocast():
                        out = user_call("the loss function", self.spec.loss, self.compiled, batch)
                    loss, metrics = out if isinstance(out, tuple) else (out, {})
                    scaled = loss * (n / gbs)
                    if self.scaler is not None:
                        scaled = self.scaler.scale(scaled)
                    user_call("backward", scaled.backward)
                except Failure as err:
                    err.work = Work(step=step, micro_batch=first + j)
                    raise
                if n:
                    loss_sum += float(loss.detach()) * n
                    for key, value in metrics.items():
                        metric_sums[key] = metric_sums.get(key, 0.0) + float(value) * n
                self.progress += 1
            self._raise_if_aborted(step)
        except Failure as err:
            # This step is lost whatever happens: tell the peers to abandon it now (they poll
            # between micro-batches) and close the group so that none waits in a collective.
            self._abort_generation(step)
            err.workers, err.step = (self.name,), step
            if err.work is None:
                err.work = Work(step=step)
            if self.shard_index and not getattr(err, "replica_intact", False):
                replica_failed(self._store, self.replica_key, self.shard_index, err)
            raise
        except StepAborted:
            self._abort_generation(step)
            raise
        if self.loop_fault is not None:
            self.loop_fault(self, step, "computed")  # a fault injected before the reduction
        t1 = time.perf_counter()
        self._set_phase("reduce", step)
        comm = self.comm
        assert comm is not None, "step before join"
        total = self.spec.global_batch_size // self.spec.micro_batch_size
        extra = self.buffer_sync.contributions(
            rank=comm.rank, width=comm.world_size, first=first, count=count, total=total
        )
        tail = self._status_tail
        if tail is not None:
            tail.zero_()  # reduced with the gradient every step: last step's sums must go
        in_tail = False
        if status is not None:  # the step's totals, known to every rank after the reduce
            status[2] = max(float(status[2]), float(self.preempting))  # a notice mid-step too
            status[0] += loss_sum
            status[1] += sum(n for n, _ in loaded.batches)
            for i, key in enumerate(self._status_metrics or ()):
                status[4 + i] += metric_sums.get(key, 0.0)
        if self._sharded is not None:
            try:
                self._grad_norm = self._sharded.reduce(comm, status, extra)
            except BaseException:
                self._abort_generation(step)
                raise
            self.buffer_sync.reduced(extra)
            return self._step_result(step, loaded, loss_sum, metric_sums, t0, t1, data_wait_s)
        if status is not None:
            in_tail = overlap is None and status_in_tail(
                tail, len(status), self.spec.global_batch_size)
            if in_tail:
                assert tail is not None
                tail[: len(status)].copy_(status)
            else:
                extra = [*extra, status]
        try:
            if overlap is not None:
                if not overlap.armed:  # no micro-batch here: the same buckets, the same order
                    overlap.arm(comm)
                overlap.launch_rest()
                self._load_ahead(ahead, step + 1, first)
                overlap.finish()  # the buckets still in flight
                comm.allreduce_sum(extra)
            else:
                works = comm.allreduce_start(self._reduced + extra)
                self._load_ahead(ahead, step + 1, first)
                comm.wait_all(works)
        except BaseException:
            self._abort_generation(step)  # no peer waits on this rank in the next collective
            raise
        self._reduced_step = step
        if in_tail:
            assert status is not None and tail is not None
            status.copy_(tail[: len(status)])
        self.buffer_sync.reduced(extra)
        # The reduced gradient is the same on every rank: its norm tells every rank (and the
        # controller) whether the update is finite, and serves the clipping at apply.
        self._grad_norm = _global_norm(self.grad_buffers)
        return self._step_result(step, loaded, loss_sum, metric_sums, t0, t1, data_wait_s)

    def _step_result(
        self, step: int, loaded: _Loaded, loss_sum: float, metric_sums: dict[str, float],
        t0: float, t1: float, data_wait_s: float,
    ) -> dict[str, Any]:
        overflow = False
        if self.scaler is not None:  # the buffers hold scaled gradients
            self._grad_norm /= self.scaler.get_scale()
            # The same on every replica (the gradient is reduced): all skip it alike at apply.
            overflow = not math.isfinite(self._grad_norm)
        t2 = time.perf_counter()
        self._set_phase("idle", step)
        return {
            "grad_norm": self._grad_norm,
            "overflow": overflow,
            "loss_sum": loss_sum,
            "n": int(sum(n for n, _ in loaded.batches)),
            "metric_sums": metric_sums,
            "ids": loaded.served.ids,  # what dataset[i] was called with, not an echo of ids
            "digests": loaded.served.digests,
            "data_wait_s": data_wait_s,
            "compute_s": t1 - t0 - data_wait_s,
            "reduce_s": t2 - t1,
            "preempting": self.preempting,
        }

    @fans_out()
    def commit(self, gen: int, steps_done: int, *, skipped: int = -1) -> int:
        """Applies the pending step if the controller counts it committed; returns steps done."""
        self._check(gen)
        self._settle(steps_done, skipped)
        self._set_phase("idle", self.steps_done)  # not "apply": the call is over
        return self.steps_done

    def _autocast(self) -> Any:
        """The forward's mixed precision (``spec.precision``); a no-op in full precision."""
        if self.spec.precision is None:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.spec.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _settle(self, steps_done: int, skipped: int = -1, *, allow_behind: bool = False) -> None:
        if self.pending is not None:
            if self.pending == steps_done - 1 and self.pending == skipped:
                self._drop_pending()  # done, without its update
                self.steps_done += 1
            elif self.pending == steps_done - 1:
                self._apply()
            else:
                self._drop_pending()
        if self.steps_done != steps_done and not allow_behind:
            raise PlanariaError(
                f"{self.name} has {self.steps_done} steps done, the controller {steps_done}"
            )

    def _wait_while_held(self) -> None:
        """Under a hold, the pending step waits here, unapplied, until the hold lets it pass
        (ckpt_advance, ckpt_release) or the generation is aborted (it is then dropped)."""
        with self._hold:
            while (self._hold_below is not None and self.pending is not None
                   and self.pending >= self._hold_below):
                if self._aborted_gen >= self.gen:
                    raise StepAborted(f"{self.name} dropped held step {self.pending}: the "
                                      "generation was aborted")
                self._set_phase("held", self.pending)
                self._hold.wait(0.05)

    def _apply(self) -> None:
        self._wait_while_held()
        with self._state_lock:
            self._apply_locked()

    def _apply_locked(self) -> None:
        self._set_phase("apply", self.pending if self.pending is not None else -1)
        clip = self.spec.grad_clip_norm
        if self.scaler is not None:
            user_call("GradScaler.unscale_", self.scaler.unscale_, self.optimizer)
        if clip is not None and math.isfinite(self._grad_norm):
            # torch's clip_grad_norm_, with the norm computed after the reduce
            coef = min(1.0, clip / (self._grad_norm + 1e-6))
            if coef < 1.0:
                grads = self._sharded.grads() if self._sharded is not None else self.grad_buffers
                for flat in grads:
                    flat.mul_(coef)
        if self.scaler is not None:  # skips the update on an overflow, then backs off the scale
            user_call("optimizer.step", self.scaler.step, self.optimizer)
            self.scaler.update()
        else:
            user_call("optimizer.step", self.optimizer.step)
        if self.scheduler is not None:
            user_call("lr_scheduler.step", self.scheduler.step)
        self.buffer_sync.commit()
        self._drop_pending()
        self.steps_done += 1

    def _drop_pending(self) -> None:
        for flat in self.grad_buffers:
            flat.zero_()
        if self._sharded is not None:
            self._sharded.zero()
        with self._state_lock:
            if self.pending is not None:
                self.buffer_sync.rollback()
            self.pending = None

    # ---- data ---------------------------------------------------------------------------------

    def _own_share(self, ids: np.ndarray) -> tuple[int, int, np.ndarray, int]:
        """(first, count, ids, rounds): the micro-batches this worker runs of the ``ids`` its
        replica was given, and how many forwards each of the replica's workers makes."""
        first, count = self._micro_batches(len(ids))
        if self.k == 1:
            return first, count, ids, count
        sub, own = micro_batch_range(count, self.k, self.shard_index)
        mbs = self.spec.micro_batch_size
        return first + sub, own, ids[sub * mbs : (sub + own) * mbs], -(-count // self.k)

    def _micro_batches(self, n_ids: int) -> tuple[int, int]:
        """(first, count): this rank's micro-batches in the global batch; checks the ids fit."""
        assert self.comm is not None
        spec = self.spec
        total = spec.global_batch_size // spec.micro_batch_size
        first, count = micro_batch_range(total, self.comm.world_size, self.comm.rank)
        if n_ids != count * spec.micro_batch_size:
            raise PlanariaError(
                f"{self.name} (rank {self.comm.rank} of {self.comm.world_size}) got {n_ids} "
                f"ids, not its {count} micro-batches of {spec.micro_batch_size}"
            )
        return first, count

    def _load(self, ids: np.ndarray, step: int, first: int = 0) -> _Loaded:
        """Loads whole micro-batches (``first``: the first one's place in the global batch);
        runs in the loader thread (which touches no global generator), or on the training
        thread for a dataset that draws from them. Skipped samples (a work fault the user
        chose to skip) are left out; a micro-batch left with none is ``(0, None)``. Each
        sample bumps the progress, and the heartbeat names it."""
        mbs, seed, base = self.spec.micro_batch_size, self.spec.seed, self.dataset.__getitem__
        reseed = bool(self._global_draws)  # then never in the loader thread: _want_prefetch
        self._loader_thread = current_thread_ids()

        def getitem(i: int) -> Any:
            self._loading = f"i{i}"
            self.progress += 1
            return base(i)

        served = Served(digests_on=self.record_digests)
        skip = self.skipped_samples
        out: list[tuple[int, Any]] = []
        for start in range(0, len(ids), mbs):
            chunk = ids[start : start + mbs].tolist()
            if skip:
                chunk = [i for i in chunk if i not in skip]
            if not chunk:
                out.append((0, None))
                continue
            # dataset[i] for each, with the sample's own random stream, recorded as served
            try:
                samples = user_call("dataset[i]", serve_samples, seed, step, getitem, chunk, reseed)
            except Failure as err:
                sample = getattr(err.__cause__, "planaria_sample", None)
                err.work = Work(step=step, micro_batch=first + start // mbs, sample=sample)
                raise
            served.extend(chunk, samples)
            batch = user_call("collate", self.collate, samples)
            out.append((len(chunk), _to_device(batch, self.device)))
        return _Loaded(out, served)

    def _fingerprint_sample(self, i: int) -> Any:
        """``dataset[i]`` at setup (step -1), noting the global generators it draws from."""
        sample, drawn = probe_sample(self.spec.seed, -1, self.dataset.__getitem__, i)
        self._global_draws.update(drawn)
        return sample

    def _want_prefetch(self) -> bool:
        """RunConfig.prefetch, or (auto) whether this node has a core to spare for a loader
        thread: more cores than the planaria workers alive on it use. Never for a dataset
        that draws from the global generators: they are the process's, and the training
        thread draws from torch's (dropout) and seeds it while the loader thread would run."""
        if self._global_draws:
            return False
        if self._prefetch_setting is not None:
            return self._prefetch_setting
        workers = max(1, len(live_workers()))
        return (os.cpu_count() or 1) > workers * self.threads

    def _prefetch(self, ids: np.ndarray, step: int, first: int) -> None:
        if not self._prefetch_on:
            return
        self._prefetched = (self._share_key(ids, step),
                            self._loader.submit(self._load, ids, step, first))

    def _share_key(self, ids: np.ndarray, step: int) -> bytes:
        """What a share loaded ahead is found by: its ids, its step and the skipped samples
        it was loaded without."""
        return _share_key(ids, step) + hash(self.skipped_samples).to_bytes(8, "little",
                                                                           signed=True)

    def _load_ahead(self, ids: np.ndarray | None, step: int, first: int) -> None:
        """Loads step ``step``'s share now, on this thread, while the gradient's all-reduce
        is in flight: the thread would only wait for it (without a spare core there is no
        loader thread, see :meth:`_want_prefetch`); the next :meth:`_take` finds it. A
        dataset error is kept for that step, which raises it as its own."""
        if ids is None:
            return
        phase, at = self.phase, self.phase_step
        self._set_phase("loading", step)  # its own work, not a wait on the peers
        future: Future[_Loaded] = Future()
        try:
            future.set_result(self._load(ids, step, first))
        except Exception as err:  # the next step's error, not this one's
            future.set_exception(err)
        finally:
            self._set_phase(phase, at)
        self._prefetched = (self._share_key(ids, step), future)

    def _take(self, ids: np.ndarray, step: int, first: int) -> _Loaded:
        if self._prefetched is not None and self._prefetched[0] == self._share_key(ids, step):
            future = self._prefetched[1]
            self._prefetched = None
            return future.result()
        self._prefetched = None
        return self._load(ids, step, first)

    # ---- state: hot-join and checkpoints ---------------------------------------------------

    @fans_out(merge_meta)
    def state_meta(self, gen: int) -> dict[str, Any]:
        """What a joiner needs besides tensors: the layout, the JSON metadata, steps done."""
        self._check(gen)
        tensors, meta = flatten_state(self.model, self.optimizer, self.scheduler)
        meta = self._extra_state_get(meta)
        return {"layout": tensor_layout(tensors), "meta": meta, "steps_done": self.steps_done,
                "on_host": sorted(k for k, v in tensors.items() if v.device.type == "cpu")}

    @fans_out(merge_sum)
    def send_state(self, gen: int, dsts: list[int]) -> int:
        """Sends the whole state to ranks ``dsts`` over the generation's group; returns bytes."""
        self._check(gen)
        self._refuse_if_dirty("send its state")
        assert self.comm is not None
        self._set_phase("send_state", self.steps_done)
        tensors, _ = flatten_state(self.model, self.optimizer, self.scheduler)
        big, small = _transfer_plan(tensors)
        buffers = [tensors[k].contiguous() for k in big]
        # Small tensors coalesced on the group's device (Adam's step counters live on the
        # host beside CUDA parameters); big ones go as they are, staged if need be.
        wire = self.comm.device
        buffers += [torch.cat([tensors[k].reshape(-1).to(wire) for k in names])
                    for names in small]
        for dst in dsts:
            self.comm.send(buffers, dst, on_progress=self._bytes_moved)
        self._set_phase("idle", self.steps_done)
        return sum(_nbytes(b) for b in buffers) * len(dsts)

    @fans_out(merge_sum)
    def recv_state(self, gen: int, src: int, source: dict[str, Any]) -> int:
        """Receives the state sent by rank ``src`` straight into this replica's live tensors.

        The model's tensors, and the optimizer state pre-built at setup, are
        filled in place: no copy, and no page faults on the critical path.
        """
        self._check(gen)
        assert self.comm is not None
        if "shards" in source:  # a sharded replica's: this worker's counterpart's part
            source = source["shards"][self.shard_index]
        self._set_phase("recv_state", -1)
        live, _ = flatten_state(self.model, self.optimizer, self.scheduler)
        on_host = set(source.get("on_host", ()))
        tensors: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in source["layout"].items():
            target = live.get(name)
            want = getattr(torch, dtype)
            fits = target is not None and list(target.shape) == shape and target.dtype == want
            if not fits and name.startswith("model/"):
                raise PlanariaError(f"{name}: the joiner's model does not match the source's")
            if target is None or not fits or not target.is_contiguous():
                # Where the source keeps it (Adam's step counters on the host).
                where = torch.device("cpu") if name in on_host else self.device
                target = torch.empty(shape, dtype=want, device=where)
            tensors[name] = target
        big, small = _transfer_plan(tensors)
        flats = [
            torch.empty(
                sum(tensors[k].numel() for k in names),
                dtype=tensors[names[0]].dtype,
                device=self.comm.device,
            )
            for names in small
        ]
        with torch.no_grad():
            self.comm.recv([tensors[k] for k in big] + flats, src, on_progress=self._bytes_moved)
            for names, flat in zip(small, flats, strict=True):
                offset = 0
                for k in names:
                    n = tensors[k].numel()
                    tensors[k].copy_(flat[offset : offset + n].view_as(tensors[k]))
                    offset += n
            model_live = {f"model/{k}": local(v) for k, v in self.model.state_dict().items()}
            for name, tensor in tensors.items():
                if name in model_live and model_live[name].data_ptr() != tensor.data_ptr():
                    model_live[name].copy_(tensor)
        optim = {k: v for k, v in tensors.items() if k.startswith("optim/")}
        load_state(None, self.optimizer, self.scheduler, optim, source["meta"])
        self._extra_state_set(source["meta"])
        self._drop_pending()
        self.steps_done = int(source["steps_done"])
        self._set_phase("idle", self.steps_done)
        return sum(_nbytes(tensors[k]) for k in big) + sum(_nbytes(f) for f in flats)

    @fans_out()
    def get_state(self, gen: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Copies of the whole state (model and optimizer tensors, metadata); a sharded
        replica's leader gathers the whole tensors from its workers' shards."""
        self._check(gen)
        tensors, meta = flatten_state(self.model, self.optimizer, self.scheduler,
                                      whole=self.k > 1)
        if self.shard_index:
            return {}, {}  # gathered by the leader: only its copy leaves the replica
        return {k: v.detach().cpu().clone() for k, v in tensors.items()}, {
            **meta,
            "steps_done": self.steps_done,
        }

    @fans_out(merge_checksums)
    def checksum(self, gen: int) -> int:
        self._check(gen)
        return model_checksum(self.model)

    # ---- fencing, heartbeat, diagnostics --------------------------------------------------

    @ray.method(concurrency_group="control")
    def abort(self, gen: int) -> None:
        """A peer of generation ``gen`` failed: abandon its step between micro-batches.

        The controller's call, run beside the step (the control concurrency group), so
        no worker polls for it: nothing per step, nothing per second. A collective of that
        generation in progress is interrupted: a survivor does not wait on the transport to
        notice the dead peer."""
        comm = self.comm
        if comm is not None and comm.gen <= gen:
            comm.interrupt()
        self._aborted_gen = max(self._aborted_gen, gen)
        for follower in self._followers:  # no answer awaited: the replica's abandon together
            follower.abort.remote(gen)

    def _raise_if_aborted(self, step: int) -> None:
        """Called between micro-batches: a peer failed during this step (see :meth:`abort`).

        Not in a sharded replica: its workers would see the flag at different micro-batches
        and leave one another waiting in FSDP's collectives; they go on to the reduction,
        which fails on all of them alike (planaria.sharded)."""
        comm = self.comm
        if comm is None or comm.world_size == 1 or self.k > 1:
            return
        if self._aborted_gen >= self.gen:
            raise StepAborted(f"{self.name} abandoned step {step}: a peer failed")

    def _abort_generation(self, step: int) -> None:
        with contextlib.suppress(Exception):
            self._store.set(store_keys.abort(self.gen), str(step))
        if self.comm is not None:
            self.comm.close()

    def _refuse_if_fenced(self) -> None:
        """A call queued before this worker was evicted finds the fence and ends the process."""
        if self._store.check([store_keys.fence(self.name)]):
            _log.warning("%s was fenced off by the controller; exiting", self.name)
            os._exit(0)

    def _enter(self, gen: int) -> None:
        self._refuse_if_fenced()
        if gen < self.gen:
            raise StaleGeneration(
                f"{self.name} is in generation {self.gen}, refused call from {gen}"
            )
        self.gen = gen

    def _check(self, gen: int) -> None:
        self._refuse_if_fenced()
        if gen != self.gen:
            raise StaleGeneration(
                f"{self.name} is in generation {self.gen}, refused a call from generation {gen}"
            )

    def _set_phase(self, phase: str, step: int) -> None:
        self.phase, self.phase_step = phase, step
        self.progress += 1

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.preempting = True
        self._wake_beat.set()  # the controller learns of it now, not at the next step

    def _quiet(self) -> bool:
        """The run committed a step just now: the stream vouches for this worker, no beat."""
        return time.monotonic() - self._committed_t < self._quiet_s

    def _working_threads(self) -> list[tuple[int, int]]:
        """The threads doing this worker's work now: the training thread, and the loader
        while the training thread waits for it."""
        threads = [t for t in (self._train_thread,) if t is not None]
        if self.phase == "loading" and self._loader_thread is not None:
            threads.append(self._loader_thread)
        return threads

    def _heartbeat_record(self, gap_s: float = 0.0) -> str:
        self._beat += 1  # changes every beat: the controller judges liveness on its own clock
        work = self._loading if self.phase == "loading" else self._work
        return Heartbeat(
            self._beat, self.phase, self.phase_step, self.gen, self.preempting, self.progress,
            work, self._busy.sample(), int(gap_s * 1000),
        ).format()

    def _publish_heartbeat(self) -> None:
        record = self._heartbeat_record()
        self._store.set(store_keys.heartbeat(self.name), record)

    @ray.method(concurrency_group="control")
    def probe_links(self, peers: dict[str, str], timeout_s: float) -> dict[str, Any]:
        """Beside the step: which of ``peers`` (name → probe address) answer, and this
        process's TCP connections whose bytes go unacked (planaria.links)."""
        with ThreadPoolExecutor(max_workers=max(1, len(peers))) as pool:
            reached = dict(zip(peers, pool.map(lambda a: probe(a, timeout_s),
                                               peers.values()), strict=True))
        return {"reached": reached, "stalled": stalled_connections(),
                "endpoints": local_endpoints()}

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
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = []
        for ident, frame in frames.items():
            parts.append(
                f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
            )
        return "\n".join(parts)


def _nccl_survives_errors() -> None:
    """torch's default NCCL error handling tears the process down when a collective times
    out or a communicator fails: here a survivor must live on, its group aborted, and
    rejoin the next generation. Set before the first NCCL group is built; a user's own
    setting wins."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # abort comms, keep process
    os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")  # no kill from the heartbeat
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")


def _group_address() -> str:
    """The address this worker's process groups use: the interface gloo is told to use, or
    what the host name resolves to (as gloo does)."""
    from planaria.network import interface_address

    name = os.environ.get("GLOO_SOCKET_IFNAME")
    if name:
        with contextlib.suppress(Exception):
            return interface_address(name.split(",")[0])
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _ray_node_id() -> str | None:
    try:
        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # not in a Ray worker (a test calling the class directly)
        return None


def _gcs_address() -> str | None:
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:
        return None


def _global_norm(buffers: list[torch.Tensor]) -> float:
    """The L2 norm of all the buffers together (NaN or inf if any element is). A float32
    or float64 buffer's square sum is its dot product with itself, a third of
    ``vector_norm``'s time on a CPU (BLAS); a half-precision one is summed in float32."""
    if not buffers:
        return 0.0
    squares = [
        b.dot(b).double() if b.dtype in (torch.float32, torch.float64)
        else torch.linalg.vector_norm(b.float()).double().square()
        for b in buffers
    ]
    return float(torch.stack(squares).sum().sqrt())


def _share_key(ids: np.ndarray, step: int) -> bytes:
    """What a share loaded ahead is found by: its ids and its step."""
    return ids.tobytes() + step.to_bytes(8, "little")


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _transfer_plan(tensors: dict[str, torch.Tensor]) -> tuple[list[str], list[list[str]]]:
    """Big tensors travel as they are, small ones coalesced in one buffer per dtype.

    Sender and receiver compute this from the same layout and get the same order.
    """
    names = sorted(tensors)
    big = [k for k in names if _nbytes(tensors[k]) >= SMALL_TENSOR_BYTES]
    small: dict[str, list[str]] = {}
    for k in names:
        if _nbytes(tensors[k]) < SMALL_TENSOR_BYTES:
            small.setdefault(str(tensors[k].dtype), []).append(k)
    return big, [small[d] for d in sorted(small)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
