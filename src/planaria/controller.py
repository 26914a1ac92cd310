"""The controller: one long-lived process that drives the workers step by step.

:class:`Job` owns the membership (generations of workers, each with its own
process group rendezvoused on the TCPStore hosted here), the step loop with
the commit protocol, and the step boundary (joins, drains, chaos, checkpoints).
What to do about a failure lives in :mod:`planaria.recovery`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from planaria import store_keys
from planaria._version import __version__
from planaria.attribution import Attribution, Blame, Sighting
from planaria.backoff import retry
from planaria.call_watch import CallWatch
from planaria.chaos import ChaosPlan, send_signal
from planaria.checkpoint.config import CheckpointConfig
from planaria.compile_cache import CACHE_FILE
from planaria.config import RunConfig, TrainSpec
from planaria.data_plan import DataPlan, Ledger, split_micro_batches
from planaria.drain import NodeDrainWatch
from planaria.errors import (
    ConfigError,
    DataMismatch,
    ElasticRuntimeError,
    Failure,
    InternalError,
    NonFiniteLoss,
    PlanariaError,
    Preempted,
    ReplicaDivergence,
    Work,
    WorkerLost,
    WorkerUnreachable,
    WorkFault,
    classify,
    is_death,
)
from planaria.events import EventLog
from planaria.integrity import describe_global_draws, describe_mismatch, divergent_replicas
from planaria.liveness import (
    IO_STALL_S,
    WORK_PHASES,
    Heartbeat,
    Liveness,
)
from planaria.loss_history import LossHistory
from planaria.network import (
    host_store,
    ray_is_private,
    store_address,
    warn_if_gloo_would_use_loopback,
    worker_env,
)
from planaria.placement import Placement
from planaria.policy import HangConfig, RecoveryPolicy
from planaria.ray_health import RayWatch
from planaria.reaper import Reaper
from planaria.run_ahead import RunAhead
from planaria.watchdog import StepDeadline
from planaria.workers import WorkerHandle, WorkerPool

__all__ = ["Job", "StepResult"]

_log = logging.getLogger("planaria.commits")
_mlog = logging.getLogger("planaria.membership")

RAY_START_ATTEMPTS = 3
"""Tries at starting a local Ray node (its start can time out on a loaded machine)."""
SAMPLES_NAMED = 64  # the ids a dataset_nondeterministic event names (its count has them all)
RECHECK_S = 2.0
"""A wait in which no call has ended for this long asks Ray whether one has (see CallWatch)."""
CONFIRM_S = 1.0
"""How long a failure's classification waits to learn whether a worker that answered with
an error beside a peer's death is alive (see Job._confirm_survivors)."""
LINK_GRACE_S = 1.0
"""Every rank of a run waiting on its peers this long past the step deadline is looked into:
some rank cannot be reached (planaria.links)."""
WAIT_REPORT_S = 30.0
"""A wait longer than the step deadline logs whom it still waits for, and their heartbeats,
this often (not while steps commit)."""


@dataclass
class StepResult:
    """A committed step as the controller saw it."""

    step: int
    loss: float
    width: int
    duration_s: float
    samples_per_s: float
    metrics: dict[str, float] = field(default_factory=dict)


class Job:
    """A training job: the controller side of planaria.

    Use as a context manager; :meth:`run_steps` runs steps up to a count (:meth:`train_step`
    one) and raises a :class:`~planaria.errors.Failure` when one goes wrong;
    ``job.recovery.handle(failure)`` applies the policy to it (see :mod:`planaria.recovery`).
    """

    def __init__(
        self,
        spec: TrainSpec,
        config: RunConfig,
        *,
        policy: RecoveryPolicy | None = None,
        hang: HangConfig | None = None,
        chaos: ChaosPlan | None = None,
        checkpoint: CheckpointConfig | None = None,
        listeners: Sequence[Callable[[dict[str, Any]], None]] = (),
    ) -> None:
        from planaria.recovery import Recovery

        self.spec = spec
        self.config = config
        self.policy = policy or RecoveryPolicy()
        self.hang = hang or HangConfig()
        self.chaos = chaos
        self.checkpoint_config = checkpoint
        self.checkpointer: Any = None
        if self.policy.min_replicas > config.replicas:
            raise ConfigError(
                f"min_replicas={self.policy.min_replicas} is not valid: it must be <= "
                f"replicas={config.replicas}"
            )
        micro_batches = spec.global_batch_size // spec.micro_batch_size
        _check_sharded(spec, config, micro_batches)
        if config.replicas > micro_batches:
            raise ConfigError(
                f"replicas={config.replicas} is not valid: a rank runs whole micro-batches and "
                f"the global batch has {micro_batches} (global_batch_size="
                f"{spec.global_batch_size} / micro_batch_size={spec.micro_batch_size}): use at "
                f"most {micro_batches} replicas, a smaller micro_batch_size or a larger "
                "global_batch_size"
            )
        self.run_dir = config.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = EventLog(self.run_dir)
        for listener in listeners:  # progress display, Prometheus, logging
            self.log.add_listener(listener)
        self.run_id = uuid.uuid4().hex[:12]
        self.ledger = (Ledger(self.run_dir, run_id=self.run_id, on_changed=self._served_changed)
                       if config.ledger else None)
        self.deadline = StepDeadline(self.hang)
        self.attribution = Attribution()  # the work's fault or the worker's (planaria.attribution)
        self.skipped_samples: set[int] = set()  # never loaded again: a work fault, skipped
        self.recovery = Recovery(self)
        self.run_ahead = RunAhead(self)
        self.metric_keys: tuple[str, ...] | None = None  # the loss's metrics, once seen
        self.gen = -1
        self.members: list[WorkerHandle] = []
        self.steps_done = 0
        self.last_skipped = -1  # the newest step whose update was dropped (non-finite): workers
        # learn it with the next call, as they learn of commits (see Worker._settle)
        self.losses = LossHistory()  # every committed step, 16 bytes each
        self.plan: DataPlan | None = None
        self._started_ray = False
        self.placement: Placement | None = None
        self._t0 = time.time()
        self._draining: set[str] = set()
        self._notices_seen = 0  # the store's notice counter, as last read
        self.evacuating: tuple[str, ...] = ()  # every holder of the state leaves: saved first
        self._leave_now = False
        self._drain_watch: NodeDrainWatch | None = None
        self._chaos_at: dict[str, float] = {}
        self._stuck_since: dict[str, float] = {}  # workers found stuck: when their work stopped
        self._verified_at = 0  # steps_done at the last replica checksum comparison
        self._ledger_last: tuple[int, int] | None = None  # (gen, step) last written as served
        self.hooks: list[Callable[..., None]] = []  # hook(job, phase, **info): see _hook
        self.reaper: Reaper | None = None  # ends the job's processes if this one is killed
        self.ray_watch: RayWatch | None = None  # Ray's GCS and raylet (planaria.ray_health)
        self.closed = False
        self.started = False

    # ---- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Job:
        try:
            self.start()
        except BaseException as err:  # __exit__ will not run: release workers, lease and Ray
            status = "aborted" if isinstance(err, PlanariaError) else "error"
            self.close(status=status, error=f"{type(err).__name__}: {err}")
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        status = "ok" if exc is None else ("aborted" if isinstance(exc, PlanariaError) else "error")
        try:
            self.close(status=status, error=None if exc is None else f"{type(exc).__name__}: {exc}")
        except Exception:
            if exc is None:
                raise
            # The job's own error is what the caller must see; close's is logged.
            _mlog.exception("closing the job after %s failed", type(exc).__name__)

    def start(self) -> None:
        """Starts Ray (or joins a cluster), hosts the store, starts workers, builds generation 0."""
        cfg = self.config
        self.log.emit(
            "run_start",
            run_id=self.run_id,
            replicas=cfg.replicas,
            steps=cfg.steps,
            start_step=None,  # known once a checkpoint is (or is not) resumed: see `restore`
            global_batch_size=self.spec.global_batch_size,
            micro_batch_size=self.spec.micro_batch_size,
            seed=self.spec.seed,
            num_samples=None,
            config=_describe(cfg, self.policy),
            planaria_version=__version__,
            torch_version=torch.__version__,
        )
        # Before Ray: a controller killed from here on leaves nothing behind (planaria.reaper).
        self.reaper = Reaper(self.log.path)
        self.log.add_listener(self.reaper.on_event)
        self._init_ray()
        self.ray_watch = RayWatch(self.log, owned=self._started_ray)
        if cfg.drain_poll_s is not None:
            self._drain_watch = NodeDrainWatch(cfg.drain_poll_s)
        private = ray_is_private()
        warn_if_gloo_would_use_loopback(cfg, private=private)
        host = store_address(cfg, private=private)
        self.store = host_store(host, timeout_s=60)  # listens on `host` only
        self.store_host = host
        if cfg.placement is not None:
            self.placement = Placement(cfg, name=f"planaria-{self.run_id}")
            self.placement.wait_ready(timeout_s=max(120.0, cfg.join_timeout_s))
            self.log.emit(
                "placement",
                strategy=self.placement.strategy,
                bundle=self.placement.bundle,
                nodes=self.placement.nodes(),
            )
        self.liveness = Liveness(self.store, timeout_s=self.hang.heartbeat_timeout_s)
        self._aborted_gen = -1  # the last generation told to abort (once each)
        self.pool = WorkerPool(
            self.spec,
            cfg,
            self.hang,
            self.store,
            host,
            self.log,
            max_attempts=self.policy.max_replacement_attempts,
            placement=self.placement,
            env=worker_env(cfg),
        )
        self.pool.owner_env = self.reaper.env  # warm workers carry the job's mark
        self.pool.check = self.check_ray  # a wait for workers ends when Ray's processes die
        cache_file = self.run_dir / CACHE_FILE
        if self.spec.compile and cfg.share_compile_cache and cache_file.exists():
            self.pool.compile_cache = cache_file.read_bytes()  # a resumed job starts warm
        for _ in range(cfg.replicas):
            self.pool.start()
        ready = self._wait_ready(cfg.replicas, timeout_s=max(120.0, cfg.join_timeout_s))
        self.members = ready  # so that close() releases them if a check below fails
        if len(ready) < cfg.replicas:
            raise ElasticRuntimeError(
                f"only {len(ready)} of {cfg.replicas} workers started within the deadline: check "
                "the Ray cluster has the CPUs/GPUs asked for (cpus_per_worker, use_gpu)"
            )
        ready.sort(key=lambda h: int(h.name[1:]))
        self._check_same_init(ready)
        self.pool.data_fingerprint = ready[0].info["data_fingerprint"]
        if ready[0].info.get("dataset_draws"):  # each worker found it at setup, and loads so
            drawn = ready[0].info["dataset_draws"]
            self.log.emit("dataset_global_rng", generators=drawn, loader_thread=False,
                          message=describe_global_draws(drawn))
        if self.spec.compile and cfg.share_compile_cache:
            self._keep_compile_cache(ready[0])
        self.pool.replenish()  # spares start once the members are up, never before them
        num_samples = ready[0].info["num_samples"]
        self.plan = DataPlan(num_samples, self.spec.global_batch_size, self.spec.seed)
        for handle in ready:
            handle.has_state = True
        self.members = ready
        self.started = True
        if self.checkpoint_config is not None:
            from planaria.checkpoint.coordinator import Checkpointer

            self.checkpointer = Checkpointer(self, self.checkpoint_config)
            self.checkpointer.on_start()
        self.build_generation(self.members, reason="start")
        if self.checkpointer is not None:
            try:
                self.checkpointer.resume_if_asked()
            except Failure as failure:  # a worker died while resuming: recover as from any
                self.recovery.handle(failure)

    def _keep_compile_cache(self, source: WorkerHandle) -> None:
        """Takes ``source``'s compile cache (it compiled in its setup) for the workers started
        later, and saves it in the run directory (atomically) for a resumed job."""
        try:
            data = ray.get(source.actor.compile_cache.remote(), timeout=120)
        except Exception as err:  # no cache: workers started later compile from scratch
            _log.warning("could not take %s's compile cache: %r", source.name, err)
            return
        if not data:
            return
        self.pool.compile_cache = data
        tmp = self.run_dir / f"{CACHE_FILE}.tmp"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.run_dir / CACHE_FILE)
        except OSError as err:  # a full run dir: the workers started later still get it
            _log.warning("could not keep the compile cache in %s: %s", self.run_dir, err)
            tmp.unlink(missing_ok=True)
        self.log.emit("compile_cache", worker=source.name, bytes=len(data))

    def _init_ray(self) -> None:
        if ray.is_initialized():
            return
        cfg = self.config
        address = cfg.address or os.environ.get("RAY_ADDRESS")  # a RayJob's driver has it set
        if address:
            ray.init(address=address, **cfg.ray_init_kwargs)
            return
        from planaria.ray_logs import route_ray_logs

        route_ray_logs(self.run_dir)  # Ray's notices go to RUN_DIR/ray.log, planaria's to you
        # + replacements starting while others run; a sharded replica is k workers
        workers = (cfg.replicas + cfg.spares + 2) * cfg.workers_per_replica
        logical_cpus = max(os.cpu_count() or 1, math.ceil(workers * cfg.cpus_per_worker))
        kwargs: dict[str, Any] = {
            # A new local instance even where another Ray runs on this machine (ray.init
            # with no address would join the newest one started, with other resources).
            "address": "local",
            "num_cpus": logical_cpus,
            "include_dashboard": False,
            "log_to_driver": True,
            "configure_logging": False,
        }
        kwargs.update(cfg.ray_init_kwargs)
        reaper = self.reaper
        assert reaper is not None
        def start() -> None:
            with reaper.marking():  # the session's processes are the job's
                ray.init(**kwargs)

        # A local node that did not come up in time (a loaded machine): its half-started
        # processes go, and it is started again. Ray raises a bare Exception for that.
        retry(start, what="starting Ray's local node", attempts=RAY_START_ATTEMPTS,
              retryable=lambda err: "timed out during startup" in str(err),
              backoff_s=2.0, log=_mlog, on_retry=lambda err: ray.shutdown())
        route_ray_logs(self.run_dir)
        self._started_ray = True
        node: Any = ray._private.worker._global_node
        reaper.session(node.get_session_dir_path())

    def _wait_ready(self, count: int, *, timeout_s: float) -> list[WorkerHandle]:
        ready: list[WorkerHandle] = []
        end = time.monotonic() + timeout_s
        while len(ready) < count and time.monotonic() < end:
            ready += self.pool.poll(timeout_s=min(0.5, max(0.0, end - time.monotonic())))
            if not self.pool.pending_count and len(ready) < count:
                break
        return ready

    def _check_same_init(self, handles: list[WorkerHandle]) -> None:
        sums = {h.name: h.info["checksum"] for h in handles}
        if len(set(sums.values())) > 1:
            raise ElasticRuntimeError(
                f"replicas built different initial parameters {sums}: make the model factory "
                "deterministic (it runs with torch seeded from spec.seed)"
            )
        problem = describe_mismatch({h.name: h.info["data_fingerprint"] for h in handles})
        if problem is not None:
            self.log.emit("data_mismatch", workers=[h.name for h in handles], reason=problem)
            raise DataMismatch(
                f"workers built different datasets ({problem}): make the dataset factory "
                "deterministic (it runs with random, numpy and torch seeded from spec.seed; "
                "seed anything else from spec.seed, not from the process, host or clock) "
                "and read the same files on every node"
            )

    def close(self, *, status: str = "ok", error: str | None = None) -> None:
        """Releases everything the job holds, in order: the drain watch, the checkpointer
        (its save in flight, its lease), the workers and the pool, the placement group, the
        event log (after ``run_end``), the ledger, and Ray if the job started it. Each is
        released whatever the others raised; the first error is raised after all."""
        if self.closed:
            return
        self.closed = True
        errors: list[BaseException] = []

        def release(what: str, fn: Callable[[], Any]) -> None:
            try:
                fn()
            except BaseException as err:  # the rest is released all the same
                errors.append(err)
                _mlog.warning("closing the job: %s failed: %s: %s", what, type(err).__name__,
                              err)

        lost = self.ray_watch is not None and self.ray_watch.lost is not None
        if self.ray_watch is not None:
            release("stopping the Ray watch", self.ray_watch.stop)
        if self._drain_watch is not None:  # a query to a lost GCS would hold the close
            drain_watch = self._drain_watch
            release("stopping the drain watch",
                    lambda: drain_watch.stop(wait_s=0.0 if lost else 5.0))
        if self.checkpointer is not None:
            release("closing the checkpointer", self.checkpointer.close)
        if hasattr(self, "pool"):
            for handle in list(self.members):
                release(f"releasing {handle.name}", functools.partial(self.pool.release, handle))
            release("stopping the worker pool", self.pool.shutdown)
        if self.placement is not None:
            release("removing the placement group", self.placement.remove)
        dropped = {"events": self.log.dropped,
                   "ledger": self.ledger.dropped if self.ledger is not None else 0}
        if any(dropped.values()):
            _mlog.warning("the run directory %s could not take %d event and %d ledger "
                          "records (a full disk?)", self.run_dir, dropped["events"],
                          dropped["ledger"])
        release("writing run_end", lambda: self.log.emit(
            "run_end", status=status, step=self.steps_done, wall_s=time.time() - self._t0,
            error=error, dropped=dropped,
        ))
        release("closing the event log", self.log.close)
        if self.ledger is not None:
            release("closing the ledger", self.ledger.close)
        if self._started_ray or lost:
            # A driver whose GCS or raylet is gone is disconnected too: Ray's C++ would end
            # this process at its reconnect timeout, and Ray's excepthook would wait on the
            # GCS before printing the job's error.
            release("shutting Ray down", ray.shutdown)
        if self.reaper is not None:  # what Ray left (agents whose GCS was gone), then itself
            reaper = self.reaper
            release("sweeping what Ray left", lambda: reaper.sweep(
                session=self._started_ray, marked=self._started_ray or lost))
            release("stopping the reaper", reaper.close)
        if errors:
            raise errors[0]

    def check_ray(self, *, save: bool = False, cause: BaseException | None = None) -> None:
        """Raises :class:`~planaria.errors.RayLost` once Ray's GCS or this node's raylet
        died (see :mod:`planaria.ray_health`), after saving the step in hand with ``save``
        (at a step boundary); ``cause``: a failure that followed the loss."""
        if self.ray_watch is not None and self.ray_watch.lost is not None:
            raise self.ray_watch.end(self, save=save, cause=cause) from cause

    # ---- membership --------------------------------------------------------------------------

    @property
    def width(self) -> int:
        return len(self.members)

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.members]

    def build_generation(self, members: list[WorkerHandle], *, reason: str) -> None:
        """Makes ``members`` (rank order) the next generation and sends state to newcomers.

        Raises a Failure if a member fails meanwhile; the caller recovers from it.
        """
        t0 = time.time()
        self.gen += 1
        gen = self.gen
        self.members = list(members)
        self.deadline.rescale(len(members))  # per-rank work scales with 1/width
        timeouts = (self.config.join_timeout_s, self.config.collective_timeout_s)
        # Each rank starts loading its share of the next step while the group forms.
        parts = self._split(self.steps_done, len(members))
        refs = {
            h.name: h.actor.join.remote(
                gen, rank, len(members), self.steps_done, timeouts, parts[rank],
                skipped=self.last_skipped, skip=tuple(sorted(self.skipped_samples)),
            )
            for rank, h in enumerate(members)
        }
        results = self._gather(refs, deadline_s=self.config.join_timeout_s + 5, step=None)
        self._ledger_dropped(results)
        for h in members:
            behind = results[h.name]["steps_done"] != self.steps_done
            # A restore overwrites every member's state: fresh replacements may be behind.
            if h.has_state and reason != "restore" and behind:
                raise InternalError(
                    f"{h.name} has {results[h.name]['steps_done']} steps, the job "
                    f"{self.steps_done}: its state is not the job's",
                    workers=(h.name,),
                )
        joiners = [r for r, h in enumerate(members) if not h.has_state]
        if joiners:
            self._send_state(joiners)
        self.log.emit(
            "generation",
            gen=gen,
            workers=self.names,
            world_size=len(members),
            build_s=time.time() - t0,
            reason=reason,
        )
        _mlog.info("generation %d: %s (%s)", gen, self.names, reason)

    def _send_state(self, joiners: list[int]) -> None:
        src_rank = next((r for r, h in enumerate(self.members) if h.has_state), None)
        if src_rank is None:
            raise InternalError("no member holds the state to send to the joiners")
        src = self.members[src_rank]
        t0 = time.time()
        source = self._gather(
            {src.name: src.actor.state_meta.remote(self.gen)}, deadline_s=60, step=None
        )[src.name]
        refs = {src.name: src.actor.send_state.remote(self.gen, joiners)}
        for r in joiners:
            h = self.members[r]
            refs[h.name] = h.actor.recv_state.remote(self.gen, src_rank, source)
        self._hook("join", src=src.name, joiners=[self.members[r].name for r in joiners])
        # A transfer that moves bytes is busy: its deadline grows with them (a 30 GB shard on
        # 1 GbE takes minutes), and past it the workers are judged by their bytes moving.
        nbytes = sum(math.prod(shape) * getattr(torch, dtype).itemsize
                     for shape, dtype in _layouts(source))
        deadline = (self.config.collective_timeout_s
                    + len(joiners) * nbytes / self.config.min_transfer_bytes_per_s)
        sizes = self._gather(refs, deadline_s=deadline, step=None)
        seconds = time.time() - t0
        nbytes = int(sizes[src.name])
        for r in joiners:
            self.members[r].has_state = True
        self.log.emit(
            "state_transfer",
            src=src.name,
            dst=[self.members[r].name for r in joiners],
            bytes=nbytes,
            seconds=seconds,
            gb_per_s=nbytes / seconds / 1e9 if seconds > 0 else None,
        )

    def evict(self, names: list[str] | tuple[str, ...], *, kill: bool = True) -> None:
        """Removes workers from the membership, fencing them off (and killing them)."""
        for handle in [h for h in self.members if h.name in names]:
            self.members.remove(handle)
            if kill:
                self.pool.kill(handle)
            else:
                self.pool.fence(handle.name)

    # ---- the step ----------------------------------------------------------------------------

    def train_step(self) -> StepResult:
        """Runs the next step at the current width and commits it, or raises a Failure
        (:meth:`recovery.handle <planaria.recovery.Recovery.handle>` applies the policy to it).

        A run of one step (:meth:`run_steps` with ``until`` the next step): the same
        protocol, commit and ledger as ``fit``'s runs.
        """
        return self.run_ahead.run(self.steps_done + 1)[-1]

    def run_steps(self, until: int) -> list[StepResult]:
        """Runs steps up to ``until`` (at least one, up to the next boundary where the
        controller must act) and commits them, or raises a Failure (recover from it as
        from train_step's)."""
        return self.run_ahead.run(until)

    def poll_notices(self) -> None:
        """Preemption notices that came while steps run (one store read of a counter the
        workers bump, see planaria.liveness.beat). When every member that holds the state
        got one (a spot-reclaim wave), the state is saved at once, beside the steps, and
        the generation is aborted so that they leave together once the save is written
        (:meth:`Recovery.evacuate <planaria.recovery.Recovery.evacuate>`)."""
        try:
            count = int(self.store.add(store_keys.NOTICES, 0))
        except Exception:  # the store is ours; the next poll reads it again
            return
        if count <= self._notices_seen:
            return
        self._notices_seen = count
        for handle in self.members:
            if handle.name in self._draining:
                continue
            # A sharded replica's other workers' notices are the replica's.
            for name in self._with_followers([handle.name]):
                if self.store.check([store_keys.notice(name)]):
                    self._draining.add(handle.name)
                    at = float(self.store.get(store_keys.notice(name)).decode() or time.time())
                    self._chaos_at.setdefault(handle.name, at)  # the fault's time: its notice
                    self.log.emit("preempt_notice", worker=handle.name, step=self.steps_done,
                                  source="sigterm", notice_t=at)
                    break
        holders = {h.name for h in self.members if h.has_state}
        if holders and holders <= self._draining and not self.evacuating:
            self._save_before_leaving()

    def _save_before_leaving(self) -> None:
        names = tuple(sorted(self._draining & set(self.names)))
        ck = self.checkpointer
        if ck is None or not ck.can_save or not ck.config.save_on_preemption:
            self.log.emit("preemption_unsaved", workers=list(names),
                          reason="every replica holding the state got a notice and checkpoints "
                          "are off: the last one stays until a replacement took the state")
            return
        _log.warning("every replica got a preemption notice (%s): saving the state before "
                     "they leave", ", ".join(names))
        if ck.save_beside(reason="preemption"):
            self.evacuating = names
            self._leave_now = True  # the wait in flight ends in a Preempted, whatever it got
            self._abort_generation()  # the held steps are dropped: they leave at step in hand

    def _preempt_notice(self, name: str, preempting: bool, step: int) -> None:
        if preempting and name not in self._draining:
            self._draining.add(name)
            self.log.emit("preempt_notice", worker=name, step=step, source="sigterm")

    def record_step(self, rec: dict[str, Any]) -> StepResult:
        """Records a step a run applied (:mod:`planaria.run_ahead`) as committed at its
        ``t`` (events, losses, open faults), from one rank's record of it, which holds the
        step's totals. The ledger is the caller's (:meth:`ledger_step`): it is written when
        the run ends."""
        step, t = rec["step"], rec["t"]
        if rec.get("overflow"):
            # fp16: the loss scale was too high. Not a fault: every replica skipped the
            # update and backed the scale off at apply, as a GradScaler does.
            self.log.emit("step_overflow", step=step, grad_norm=rec["grad_norm"], t=t)
        n = int(rec["global_samples"])
        loss = rec["global_loss_sum"] / n if n else math.nan
        metrics = {k: v / max(1, n) for k, v in rec.get("global_metric_sums", {}).items()}
        duration = max(1e-9, t - rec["t0"])
        self.steps_done = step + 1
        self.deadline.observe(duration)
        result = StepResult(step, loss, self.width, duration, n / duration, metrics)
        self.losses.append((step, loss))
        self.log.emit(
            "step_committed", t=t, step=step, gen=self.gen, width=self.width,
            duration_s=duration, loss=loss, samples=n, samples_per_s=result.samples_per_s,
            data_wait_s=rec["data_wait_s"], metrics=metrics,
        )
        self.recovery.on_commit(step, now=t)
        return result

    def ledger_step(self, step: int, served: dict[str, Any]) -> None:
        """The ledger's records of a step an autonomous run committed: what each rank was
        served, then the commit."""
        if self.ledger is None:
            return
        self._ledger_served(step, served)
        self.ledger.commit(step, gen=self.gen)

    def record_nonfinite(self, rec: dict[str, Any], per_worker: dict[str, Any]) -> None:
        """A run stopped at a non-finite step (applied nowhere): raises NonFiniteLoss, and
        the policy decides."""
        step = rec["step"]
        self._ledger_served(step, per_worker)
        n = int(rec["global_samples"])
        loss = rec["global_loss_sum"] / n if n else math.nan
        grad_norm = float(rec["grad_norm"])
        what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
        raise NonFiniteLoss(f"{what} at step {step}", step=step)

    def _split(self, step: int, width: int) -> list[np.ndarray]:
        """Step ``step``'s sample ids split over ``width`` ranks in whole micro-batches
        (empty parts before the plan)."""
        if self.plan is None:
            return [np.empty(0, dtype=np.int64)] * width
        return split_micro_batches(self.plan.batch(step), width, self.spec.micro_batch_size)

    def _ledger_served(self, step: int, served: dict[str, Any]) -> None:
        """Records what each rank's dataset served in this attempt (before it may commit):
        ``served`` maps each worker, in rank order, to its report (``ids``, ``digests``)."""
        if self.ledger is None:
            return
        for name, r in served.items():
            self.ledger.served(step, gen=self.gen, worker=r.get("worker", name), ids=r["ids"],
                               digests=r.get("digests"))
        self._ledger_last = (self.gen, step)

    def _served_changed(self, step: int, gen: int, worker: str, ids: list[int]) -> None:
        """The ledger saw samples of ``step`` served again with other content."""
        message = (
            f"dataset[i] served other content for {len(ids)} sample(s) of step {step} when "
            f"they were served again ({worker}, generation {gen}; samples {ids[:8]}"
            f"{' ...' if len(ids) > 8 else ''}): the dataset is not deterministic (it reads "
            "the clock, a counter, files that change, or a random generator planaria does not "
            "seed), so a run with failures does not compute the fault-free training"
        )
        _log.warning(message)
        self.log.emit("dataset_nondeterministic", step=step, gen=gen, worker=worker,
                      samples=ids[:SAMPLES_NAMED], count=len(ids), message=message)

    def _ledger_dropped(self, joined: dict[str, Any]) -> None:
        """Records what survivors were served in a step attempt that failed (from their join)."""
        if self.ledger is None:
            return
        for name, r in joined.items():
            d = r.get("dropped")
            if d and (d["gen"], d["step"]) != self._ledger_last:  # not recorded already
                self.ledger.served(
                    d["step"], gen=d["gen"], worker=name, ids=d["ids"], digests=d["digests"]
                )

    def skip_samples(self, samples: list[int], *, step: int | None, reason: str) -> None:
        """Leaves ``samples`` out of every step from now on (a work fault the policy skips):
        the workers learn it when the next generation is built; the event log, the ledger and
        later checkpoints record it."""
        new = sorted(set(samples) - self.skipped_samples)
        self.skipped_samples.update(new)
        self.log.emit("sample_skipped", samples=new, step=step, reason=reason,
                      total=len(self.skipped_samples))
        if self.ledger is not None:
            self.ledger.skip_samples(new, step=step, reason=reason)
        _log.warning("skipping samples %s from step %s on: %s", new, step, reason)

    def commit_all(self) -> None:
        """Makes every worker apply the committed steps now (before a snapshot or the end)."""
        refs = {
            h.name: h.actor.commit.remote(self.gen, self.steps_done, skipped=self.last_skipped)
            for h in self.members
        }
        self._gather(refs, deadline_s=self.deadline.seconds, step=None)

    def skip_pending(self, step: int) -> None:
        """Drops step ``step``'s update everywhere; the step counts as done (non-finite loss).

        Nothing is sent now: like a commit, the skip rides on each worker's next call, so a
        fault meanwhile cannot leave some workers past the step and others not.
        """
        self.last_skipped = step
        self.steps_done = step + 1
        self.log.emit("step_skipped", step=step, reason="nonfinite_loss")
        if self.ledger is not None:
            self.ledger.commit(step, gen=self.gen, skipped=True)

    def gather(self, refs: dict[str, Any], *, deadline_s: float, step: int | None,
               poll: Callable[[], None] | None = None) -> dict[str, Any]:  # public name
        return self._gather(refs, deadline_s=deadline_s, step=step, poll=poll)

    def _gather(
        self, refs: dict[str, Any], *, deadline_s: float, step: int | None,
        poll: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Waits for one call per worker; raises the classified Failure if any went wrong.

        Every wait has a deadline, but busy is not hung: while waiting, a worker is
        hung only if its heartbeat stops or it makes no progress in its own work past
        the learned deadline (:class:`~planaria.liveness.Liveness`). From the first
        error on, the generation is aborted (``abort/<gen>``): the others abandon the
        call between micro-batches and answer, so the wait ends in about one
        micro-batch. Past ``deadline_s`` (the last resort), the workers not waiting
        on a peer are hung, or all of them if every one is. ``poll`` is called
        between waits (at least every 0.25 s) while no call has failed.

        Calls end by Ray's notices (:class:`~planaria.call_watch.CallWatch`); when none
        has come for :data:`RECHECK_S`, Ray is asked directly, so a lost notice costs
        seconds. A worker evicted as hung is not waited for: it was killed. A wait past
        the step deadline logs, every :data:`WAIT_REPORT_S`, whom it waits for and what
        they are doing.
        """
        by_ref = {ref: name for name, ref in refs.items()}
        results: dict[str, Any] = {}
        errors: dict[str, BaseException] = {}
        hung: list[str] = []
        work_hung: dict[str, tuple[Work | None, str]] = {}  # hangs the work is to blame for
        end = time.monotonic() + deadline_s
        calls = CallWatch(by_ref)  # a wait costs O(1) in the number of calls
        self.liveness.watch(self._with_followers(list(refs)))
        unreachable: list[str] = []  # ranks cut off from their peers (planaria.links)
        began = last_end = last_report = time.monotonic()
        next_link_check = began
        while len(calls):
            now = time.monotonic()
            if now >= end:
                late = self._past_deadline([by_ref[r] for r in calls.pending])
                if late:
                    hung += late
                    break
                end = now + 1.0  # every one of them still moves checkpoint bytes
            ended = calls.wait(min(0.25, end - now))
            if not ended and time.monotonic() - last_end >= RECHECK_S:
                ended = calls.recheck()  # a second source: Ray's callback may not have come
                if ended:
                    _log.warning("the calls to %s had ended without Ray's notice; found by "
                                 "asking", ", ".join(by_ref[r] for r in ended))
                last_end = time.monotonic()  # asked: the next ask is RECHECK_S away
            if ended:
                last_end = time.monotonic()
            for ref in ended:
                name = by_ref[ref]
                try:
                    results[name] = ray.get(ref)
                except Exception as err:
                    errors[name] = err
                    if is_death(err):  # known now; classified once the others answered
                        self.log.emit("failure_seen", worker=name, how="death")
                    self._abort_generation()
            if not len(calls):
                break
            if poll is not None and not errors:
                poll()
                if self.liveness.vouched_recently():
                    continue  # steps commit: every rank of the run is alive and moving
            now = time.monotonic()
            if now - last_report >= WAIT_REPORT_S and now - began >= self.deadline.seconds:
                last_report = now  # longer than a step should take: say what holds it
                self._report_wait([by_ref[r] for r in calls.pending], step, now - began)
            pending = [by_ref[r] for r in calls.pending]
            found = self.liveness.hung(self._with_followers(pending), self._deadline_for)
            # In a sharded replica, workers wait inside FSDP's collectives (in phase compute)
            # on one that is frozen (judged by the heartbeat timeout) or busy: only a replica
            # none of whose workers moves is stuck.
            found = [n for n in found if self.liveness.stopped(n) or not self._peer_moves(n)]
            for name in found:  # a replica's other worker: dated from its own record
                if "." in name:
                    seen = (self.liveness.last_alive_t(name) if self.liveness.stopped(name)
                            else self.liveness.last_progress_t(name))
                    self._stuck_since.setdefault(name.split(".")[0], seen or time.time())
            stale = self._leaders(found)
            stale = [n for n in stale if n not in hung]
            if not stale and now >= next_link_check and len(pending) > 1:
                next_link_check = now + 1.0
                watched = self._with_followers(pending)
                if self.liveness.all_waiting(watched, self.deadline.seconds + LINK_GRACE_S,
                                             phases=frozenset({"reduce"})):
                    next_link_check = now + self.deadline.seconds
                    stale = self._find_unreachable(pending)
                    unreachable += stale
            if stale:
                hung += stale
                for name in stale:
                    self._judge_hang(name, work_hung)
                self._abort_generation()
                self._evict_hung(stale)  # killed: nothing more to wait for from them
                calls.drop(r for r in calls.pending if by_ref[r] in stale)
        leave, self._leave_now = self._leave_now, False
        if not errors and not hung and not leave:
            return results
        self._confirm_survivors(errors, hung, list(results))
        hung_set = [h for h in dict.fromkeys(hung) if h not in errors or is_death(errors[h])]
        if hung_set:
            self._evict_hung([h for h in hung_set if h in self.names])
            for h in hung_set:
                errors.pop(h, None)  # the death is the one we caused
        faulty = set(hung_set) | {n for n, e in errors.items() if is_death(e)}
        if unreachable and set(hung_set) <= set(unreachable) and not any(
                is_death(e) for n, e in errors.items() if n not in hung_set):
            failure: Failure = WorkerUnreachable(
                f"worker {', '.join(hung_set)} could not be reached by its peers (its "
                "process-group link is dead though it runs): evicted", workers=tuple(hung_set),
                step=step)
        elif self.evacuating and (leave or errors):
            failure = Preempted(
                f"{', '.join(self.evacuating)} leave together: every replica holding the "
                "state got a preemption notice", workers=self.evacuating, step=step)
        elif work_hung:
            name, (work, why) = next(iter(work_hung.items()))
            failure = WorkFault(
                f"{work.describe() if work else 'the work'} made no progress past its "
                f"deadline on more than one worker ({why}): the work, not a worker, is at "
                "fault (a deadlock or an endless loop on that data?); fix it, raise "
                "HangConfig(floor_s=...) if it is only slow, or set "
                "RecoveryPolicy(on_work_fault='skip') to skip its samples",
                workers=tuple(work_hung), step=step if step is not None else
                (work.step if work else None), work=work,
            )
        else:
            failure = classify(
            errors,
            hung=tuple(hung_set),
            preempting=tuple(sorted(self._draining)),
            live_after=len([n for n in self.names if n not in faulty]),
            step=step,
            )
        if step is not None:
            self.log.emit(
                "step_failed",
                step=step,
                gen=self.gen,
                kind=failure.kind,
                workers=list(failure.workers),
            )
        raise failure

    def _confirm_survivors(
        self, errors: dict[str, BaseException], hung: list[str], answered: list[str]
    ) -> None:
        """Workers killed together die a few milliseconds apart: one still running when its
        peer's death broke the collective answers with that error (or, done already, with
        its result), then dies itself. Beside a death or a hang, every other worker that
        answered is asked whether it is alive (a call beside any step, up to
        :data:`CONFIRM_S`); one that died gets its death as its error, so the failure is
        classified as what happened, not as what it looked like."""
        if not hung and not any(is_death(e) for e in errors.values()):
            return
        suspects = [n for n, e in errors.items() if not is_death(e) and n not in hung]
        suspects += [n for n in answered if n not in errors and n not in hung]
        handles = {h.name: h for h in self.members if h.name in suspects}
        if not handles:
            return
        pings = {h.actor.alive.remote(): name for name, h in handles.items()}
        done, _ = ray.wait(list(pings), num_returns=len(pings), timeout=CONFIRM_S)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as err:
                if is_death(err):
                    errors[pings[ref]] = err

    def _report_wait(self, names: list[str], step: int | None, waited_s: float) -> None:
        """A long wait says who it waits for and what each one's heartbeat says (a call that
        is busy, not hung, can take this long: a checkpoint read, a long step)."""
        self.liveness.observe(names)
        seen = []
        for n in names:
            hb = self.liveness.last(n)
            what = "no heartbeat" if hb is None else f"{hb.phase} at step {hb.step}, gen {hb.gen}"
            seen.append(f"{n} ({what}, silent {self.liveness.silent_s(n):.1f} s)")
        _log.warning("waited %.0f s%s on %s", waited_s,
                     "" if step is None else f" for step {step}", "; ".join(seen))

    def _abort_generation(self) -> None:
        """Tells every member of this generation to abandon what it is doing: a call beside
        the step (:meth:`Worker.abort <planaria.worker.Worker.abort>`, so no worker polls
        for it), and ``abort/<gen>`` in the store for ranks waiting in a rendezvous."""
        if self._aborted_gen == self.gen:
            return
        self._aborted_gen = self.gen
        try:
            self.store.set(store_keys.abort(self.gen), "1")
        except Exception:  # the store is ours; nothing to do if it fails but wait
            _log.debug("could not set abort/%d", self.gen, exc_info=True)
        for handle in self.members:  # fire and forget: a dead one needs no telling
            handle.actor.abort.remote(self.gen)

    def _with_followers(self, names: list[str]) -> list[str]:
        """``names`` and, for a sharded replica, its other workers (``w<N>.<i>``): each one's
        own heartbeat is watched (a stopped follower stalls its leader in a collective)."""
        k = self.config.workers_per_replica
        if k == 1:
            return names
        return [*names, *(f"{n}.{i}" for n in names for i in range(1, k))]

    def _peer_moves(self, name: str) -> bool:
        """Another worker of ``name``'s replica is frozen or paused (its heartbeat silent,
        not yet past the heartbeat timeout) or makes progress (a busy micro-batch): ``name``
        may be waiting on it inside the replica's collectives."""
        live = self.liveness
        for peer in self._with_followers([name.split(".", 1)[0]]):
            if peer == name:
                continue
            if live.silent_s(peer) > live.vouch_s and not live.stopped(peer):
                return True
            hb = live.last(peer)
            if hb is not None and live.still_s(peer) <= self._deadline_for(hb):
                return True
        return False

    @staticmethod
    def _leaders(names: list[str]) -> list[str]:
        """The replicas (their leaders' names) that ``names`` belong to."""
        return list(dict.fromkeys(n.split(".", 1)[0] for n in names))

    def _find_unreachable(self, names: list[str]) -> list[str]:
        """Every rank of the run waits on its peers past the deadline: probes them all
        (planaria.links) and returns the replicas whose ranks cannot be reached (none when
        no one is to blame: the failure then rebuilds the generation on fresh links)."""
        from concurrent.futures import ThreadPoolExecutor

        from planaria.links import find_unreachable, probe

        watched = self._with_followers(names)
        addresses: dict[str, str] = {}
        for n in watched:
            with contextlib.suppress(Exception):
                if self.store.check([store_keys.probe(n)]):
                    addresses[n] = self.store.get(store_keys.probe(n)).decode()
        with ThreadPoolExecutor(max_workers=max(1, len(addresses))) as pool:
            mine = dict(zip(addresses, pool.map(probe, addresses.values()), strict=True))
        asks = {}
        for h in self.members:
            if h.name in names:
                peers = {n: a for n, a in addresses.items() if n.split(".")[0] != h.name}
                asks[h.actor.probe_links.remote(peers, 1.0)] = h.name
        done, _ = ray.wait(list(asks), num_returns=len(asks), timeout=2 * len(watched) + 2.0)
        reports = {}
        for ref in done:
            with contextlib.suppress(Exception):
                reports[asks[ref]] = ray.get(ref)
        verdict = find_unreachable(watched, mine, reports)
        self.log.emit("link_check", workers=watched, culprits=list(verdict.culprits),
                      reason=verdict.reason, controller_reached=mine, reports=reports)
        culprits = self._leaders(list(verdict.culprits))
        for name in culprits:  # dated from its own record: when its wait on the peers began
            self._stuck_since[name] = (self.liveness.last_progress_t(name, steps_only=True)
                                       or time.time())
        if not culprits:
            _log.warning("every rank waited on its peers past the deadline and none could be "
                         "named (%s): the generation is built again", verdict.reason)
            self._abort_generation()
            raise WorkerLost("every rank waited on its peers past the deadline (a stalled "
                             f"link; {verdict.reason}): rebuilding on fresh connections",
                             workers=(), step=None)
        return culprits

    def _deadline_for(self, hb: Heartbeat) -> float:
        """How long a worker may make no progress on its current work: the step deadline, or
        the I/O deadline while it loads samples, times the work's patience (doubled for
        every worker that hung on it: see planaria.attribution)."""
        base = self.deadline.seconds
        if hb.phase == "loading":
            base = max(base, self.hang.io_timeout_s)
        return base * self.attribution.patience(_work_of(hb))

    def _judge_hang(self, name: str, work_hung: dict[str, tuple[Work | None, str]]) -> None:
        """A worker is stuck in its own work (its heartbeat lives): is the work to blame?
        A stopped process (no heartbeat) is the process's, never the work's."""
        hb = self.liveness.last(name)
        if hb is None or self.liveness.stopped(name) or hb.phase not in WORK_PHASES:
            return
        # Dated from its own record: when its work stopped moving, not when it was found.
        self._stuck_since[name] = self.liveness.last_progress_t(name) or time.time()
        work = _work_of(hb)
        handle = next((h for h in self.members if h.name == name), None)
        judgement = self.attribution.judge(
            Sighting(name, work, f"hung:{hb.phase}", how="hung",
                     node=None if handle is None else handle.info.get("ray_node")),
            width=self.width)
        self.log.emit("attribution", worker=name, work=None if work is None else work.describe(),
                      how="hung", blame=judgement.blame.value, reason=judgement.reason)
        if judgement.blame is Blame.WORK:
            work_hung[name] = (work, judgement.reason)

    def _past_deadline(self, names: list[str]) -> list[str]:
        """The last resort: past the call's deadline, whoever is not waiting on a peer; none
        while every one of them still moves checkpoint bytes (a slow read is not a hang)."""
        self.liveness.observe(names)
        if all(self.liveness.moving(n, IO_STALL_S) for n in names):
            return []
        working = [
            n for n in names
            if (hb := self.liveness.last(n)) is None or hb.phase in WORK_PHASES
        ]
        return working or names

    def _evict_hung(self, names: list[str]) -> None:
        for name in names:
            handle = next((h for h in self.members if h.name == name), None)
            if handle is None:
                continue
            hb = self.liveness.last(name)
            stack = self.pool.stack(handle, timeout_s=0.5)
            self.log.emit(
                "hang_stack",
                worker=name,
                stack=stack,
                phase=None if hb is None else hb.phase,
                silent_s=round(self.liveness.silent_s(name), 3),
            )
            self.evict([name])

    # ---- the step boundary -------------------------------------------------------------------

    def boundary(self) -> None:
        """Between steps: drain preempted workers, admit ready replacements, save, inject chaos."""
        self.check_ray(save=True)  # Ray's own processes died: save and end
        self._verify_if_due()  # before a joiner could copy a diverged replica's state
        self._hook("boundary")
        ready = self.pool.poll(timeout_s=0.0)
        if ready:  # first, so that a joiner can take the state from a worker about to drain
            self.recovery.admit(ready)
        self._notice_draining_nodes()
        if self._draining:
            draining = sorted(self._draining)
            self._draining.clear()
            self.recovery.drain(draining)
        if self.checkpointer is not None:
            self.checkpointer.maybe_save()
        self._chaos_by_time()

    def boundary_wanted(self) -> str | None:
        """Why a run of steps should end at the next boundary now, or None: something the
        controller could not plan for (see :mod:`planaria.run_ahead`). Queries nothing
        remote but the replacements' readiness."""
        if self.ray_watch is not None and self.ray_watch.lost is not None:
            return "ray_lost"
        if self.width < self.config.replicas and self.pool.has_ready():
            return "join"
        if self._drain_watch is not None:
            nodes = self._drain_watch.draining()
            if nodes and any(h.info.get("ray_node") in nodes for h in self.members):
                return "drain"
        if self.chaos is not None and self.chaos.time_due(self.elapsed_s):
            return "chaos"
        if self.checkpointer is not None and self.checkpointer.due_by_time():
            return "checkpoint"
        return None

    def _notice_draining_nodes(self) -> None:
        """The members on nodes Ray drains get their notice now (as if each had got SIGTERM);
        standby spares there are let go. Reads the watch's last answer: no query here."""
        if self._drain_watch is None:
            return
        nodes = self._drain_watch.draining()
        if not nodes:
            return
        for handle in self.members:
            node = handle.info.get("ray_node")
            if node in nodes and handle.name not in self._draining:
                self._draining.add(handle.name)
                deadline = nodes[node] / 1000 if nodes[node] else None
                self.log.emit(
                    "preempt_notice", worker=handle.name, step=self.steps_done,
                    source="node_drain", node=node, deadline_t=deadline,
                )
        self.pool.drop_spares_on(set(nodes))

    def keep_draining(self, name: str) -> None:
        """``name`` got a preemption notice but stays until a later boundary (see drain)."""
        self._draining.add(name)

    def wait_for_width(self, width: int, *, timeout_s: float) -> int:
        """Waits at a step boundary, admitting replacements as they become ready, until
        ``width`` replicas are live or ``timeout_s`` has passed; returns the width reached.

        For a run that should end at full width, or a benchmark that must see the
        hot-join: training does not advance while it waits. Raises a Failure if one
        happens meanwhile (recover from it as from a step's).
        """
        end = time.monotonic() + timeout_s
        while self.width < width and time.monotonic() < end:
            ready = self.pool.poll(timeout_s=min(0.2, max(0.0, end - time.monotonic())))
            if ready:
                self.recovery.admit(ready)
            if not ready and self.pool.pending_count == 0:
                break  # nothing is coming
        return self.width

    def wait_for_spares(self, *, timeout_s: float) -> int:
        """Waits until ``config.spares`` standby workers are warm or ``timeout_s`` has passed;
        returns how many stand by. Spares start with the job and warm up in the background;
        a run (or a benchmark) that must not meet a fault without one can wait here."""
        end = time.monotonic() + timeout_s
        while len(self.pool.standby) < self.config.spares and time.monotonic() < end:
            ready = self.pool.poll(timeout_s=min(0.2, max(0.0, end - time.monotonic())))
            if ready:  # a replacement became ready meanwhile: it joins as at any boundary
                self.recovery.admit(ready)
            if not self.pool.spares_starting and len(self.pool.standby) < self.config.spares:
                break  # none is coming (their starts failed)
        return len(self.pool.standby)

    def hook(self, phase: str, **info: Any) -> None:  # the checkpoint coordinator's name
        self._hook(phase, **info)

    def _hook(self, phase: str, **info: Any) -> None:
        """Calls the hooks at a named phase: ``boundary`` (a step boundary begins), ``join``
        (state transfer to joiners in flight), ``save`` (checkpoint writers started),
        ``restore`` (a restore's reads in flight). Fault campaigns inject faults here.
        A hook with a ``next_step(after) -> int | None`` method is called at the boundaries
        it names (and wherever the job has one anyway); one without is called at every step
        (the job then runs one step at a time)."""
        for hook in self.hooks:
            hook(self, phase, **info)

    def _chaos_by_time(self) -> None:
        if self.chaos is None:
            return
        self._inject([(ev.action, ev.target) for ev in
                      self.chaos.due(step=None, elapsed_s=self.elapsed_s) if ev.step is None],
                     self.steps_done)

    def _chaos_during_step(self, step: int) -> None:
        if self.chaos is None:
            return
        due = self.chaos.due(step=step, elapsed_s=self.elapsed_s)
        if any(ev.step is not None for ev in due):
            # Land inside the step: after dispatch, about a third of a typical step in; the
            # faults planned for one step land together.
            typical = self.deadline.typical_step_s or 0.05
            time.sleep(min(0.5, typical / 3))
        self._inject([(ev.action, ev.target) for ev in due], step)

    def _inject(self, faults: list[tuple[str, str]], step: int) -> None:
        """Sends the (action, target) faults' signals back to back, then logs them: faults
        planned together land together (a survivor of the first must not have answered
        before the next lands, or a whole-job loss would read as one worker's)."""
        assert self.chaos is not None
        sent = []
        for action, target in faults:
            name = self.chaos.pick(target, self.names)
            handle = next((h for h in self.members if h.name == name), None)
            if handle is None or handle.pid is None:
                _log.warning("chaos %s:%s skipped: no such live worker", action, target)
                continue
            self._chaos_at[handle.name] = time.time()
            send_signal(action, handle.pid, slow_s=self.chaos.slow_s)
            sent.append((action, handle))
        for action, handle in sent:
            self.log.emit("chaos", action=action, worker=handle.name, pid=handle.pid, step=step)

    def fault_time(self, names: tuple[str, ...]) -> float:
        """Best estimate of when a fault happened: the chaos signal, else, from the faulty
        worker's own record, when its work stopped moving (a worker stuck with its heartbeat
        alive, or cut off from its peers) or the last heartbeat change the controller saw
        (on its own clock)."""
        times = [self._chaos_at.pop(n) for n in names if n in self._chaos_at]
        if times:
            return min(times)
        stuck = [self._stuck_since.pop(n) for n in names if n in self._stuck_since]
        if stuck:
            return min(stuck)
        beats = [t for t in (self.liveness.last_alive_t(n) for n in names) if t is not None]
        return min(beats) if beats else time.time()

    # ---- state -------------------------------------------------------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The committed training state, from rank 0 (tensors on the CPU, metadata)."""
        self.commit_all()
        head = self.members[0]
        return self._gather(
            {head.name: head.actor.get_state.remote(self.gen)}, deadline_s=300, step=None
        )[head.name]

    def save(self, root: str | None = None,
             storage_options: dict[str, Any] | None = None) -> str:
        """Saves the committed state now and waits for the commit; returns the checkpoint's
        path. ``root`` None: the job's checkpoint root; another root (a path every worker
        reaches, ``s3://...``): saved there in this run's lineage, so that a job given that
        root resumes from it (``storage_options`` are that root's; the job's own root keeps
        its own). This is also what to do after a failed final save
        (:class:`~planaria.errors.FinalSaveFailed`). Raises
        :class:`~planaria.errors.CheckpointError` if the save does not commit, and a
        :class:`~planaria.errors.Failure` if a worker fails meanwhile (recover from it as
        from a step's: ``job.recovery.handle``)."""
        if not self.started or self.closed:
            raise ElasticRuntimeError("Job.save needs a started job that is not closed")
        if self.checkpointer is None:
            if root is None:
                raise ConfigError(
                    "root=None is not valid: this job has no checkpoint root (checkpoint="
                    "None); give Job.save a root, or the job CheckpointConfig(...)"
                )
            from planaria.checkpoint.coordinator import save_under

            return save_under(self, root, storage_options)
        if root is None or self.checkpointer.root == (
                root if "://" in root else os.path.abspath(root)):
            # Its own root, under its own lease (a second saver there would fence it off).
            path: str = self.checkpointer.save_committed(reason="manual")
            return path
        return str(self.checkpointer.save_elsewhere(root, storage_options))

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        tensors, _ = self.state()
        return {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}

    def checksums(self) -> dict[str, int]:
        """Every replica's parameter checksum (they agree unless something is badly wrong)."""
        self.commit_all()
        refs = {h.name: h.actor.checksum.remote(self.gen) for h in self.members}
        return self._gather(refs, deadline_s=60, step=None)

    def verify_replicas(self) -> None:
        """Compares every replica's parameter checksum; raises ReplicaDivergence on a mismatch.

        The replicas that differ from a strict majority are named (all of them
        when there is none); the recovery treats them as lost.
        """
        answers = self.checksums()
        sums = {h.name: answers[h.name] for h in self.members}  # rank order
        self._verified_at = self.steps_done
        bad = divergent_replicas(sums)
        self.log.emit(
            "replicas_verified", step=self.steps_done, workers=sorted(sums), diverged=list(bad)
        )
        if bad:
            raise ReplicaDivergence(
                f"replica checksums disagree after {self.steps_done} steps: "
                + ", ".join(f"{n}={c:08x}" for n, c in sums.items())
                + f"; {', '.join(bad)} diverged",
                workers=bad,
                step=self.steps_done,
            )

    def _verify_if_due(self) -> None:
        every = self.config.verify_every
        if every is None or self.width < 2 or self.steps_done == 0 or self.steps_done % every:
            return
        if self._verified_at != self.steps_done:
            self.verify_replicas()

    @property
    def elapsed_s(self) -> float:
        return time.time() - self._t0



def _layouts(source: dict[str, Any]) -> list[tuple[list[int], str]]:
    """Every tensor's (shape, dtype) in a state description (a sharded replica's: each
    shard's)."""
    parts = source.get("shards", [source])
    return [(list(shape), str(dtype)) for part in parts
            for shape, dtype in part["layout"].values()]


def _work_of(hb: Heartbeat) -> Work | None:
    """The work a heartbeat names: ``m<j>`` micro-batch j of its step, ``i<id>`` a sample."""
    if hb.work.startswith("m") and hb.work[1:].isdigit():
        return Work(step=hb.step, micro_batch=int(hb.work[1:]))
    if hb.work.startswith("i") and hb.work[1:].isdigit():
        return Work(step=hb.step, sample=int(hb.work[1:]))
    return None




def _describe(cfg: RunConfig, policy: RecoveryPolicy) -> dict[str, Any]:
    return {
        "replicas": cfg.replicas,
        "steps": cfg.steps,
        "address": cfg.address,
        "placement": cfg.placement,
        "store_host": cfg.store_host,
        "network_interface": cfg.network_interface,
        "cpus_per_worker": cfg.cpus_per_worker,
        "threads_per_worker": cfg.threads,
        "use_gpu": cfg.use_gpu,
        "gpus_per_worker": cfg.gpus_per_worker if cfg.use_gpu else 0,
        "backend": cfg.process_group_backend,
        "on_worker_lost": policy.on_worker_lost,
        "min_replicas": policy.min_replicas,
    }


def _check_sharded(spec: TrainSpec, config: RunConfig, micro_batches: int) -> None:
    """What sharded replicas (``workers_per_replica`` > 1) need and do not support yet."""
    k = config.workers_per_replica
    if k == 1:
        return
    unsupported = [
        ("spec.compile", spec.compile),
        ("spec.precision='fp16'", spec.precision == "fp16"),
    ]
    for what, used in unsupported:
        if used:
            raise ConfigError(
                f"workers_per_replica={k} is not valid with {what}: sharded replicas do not "
                "support it yet; use workers_per_replica=1"
            )
    if config.replicas * k > micro_batches:
        raise ConfigError(
            f"workers_per_replica={k} is not valid with replicas={config.replicas}: every "
            f"worker runs whole micro-batches and the global batch has {micro_batches} "
            f"(global_batch_size={spec.global_batch_size} / micro_batch_size="
            f"{spec.micro_batch_size}), fewer than the {config.replicas * k} workers: use a "
            "smaller micro_batch_size, a larger global_batch_size or fewer workers"
        )
