"""A job's infrastructure: Ray (started or joined), the store every generation
rendezvous on, the placement group, the worker pool, and the watches on Ray's own
processes and on drained nodes; released in order when the job closes."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from planaria.control import startup
from planaria.control.drain import NodeDrainWatch
from planaria.control.liveness import Liveness
from planaria.control.network import (
    host_store,
    ray_is_private,
    store_address,
    warn_if_gloo_would_use_loopback,
    worker_env,
)
from planaria.control.placement import Placement
from planaria.control.pool import WorkerPool
from planaria.control.ray_health import RayWatch
from planaria.control.reaper import Reaper
from planaria.data.integrity import describe_global_draws
from planaria.wire import store_keys
from planaria.wire.lifeline import Lifelines
from planaria.worker import memory_reserve
from planaria.worker.compile_cache import CACHE_FILE

if TYPE_CHECKING:
    from planaria.config import RunConfig, TrainSpec
    from planaria.control.policy import HangConfig, RecoveryPolicy
    from planaria.control.pool import WorkerHandle
    from planaria.control.protocols import Checkpoints
    from planaria.data.plan import Ledger
    from planaria.observe.events import EventLog

__all__ = ["Runtime"]

_mlog = logging.getLogger("planaria.membership")


class Runtime:
    """What a job runs on (see the module doc). :meth:`start` brings it up, with the first
    workers starting; :meth:`close` releases it (and what the job names) in order."""

    store: Any
    store_host: str
    lifelines: Lifelines | None = None
    liveness: Liveness
    pool: WorkerPool

    def __init__(self, *, spec: TrainSpec, config: RunConfig, policy: RecoveryPolicy,
                 hang: HangConfig, log: EventLog, run_id: str, run_dir: Path) -> None:
        self.spec, self.config, self.policy, self.hang = spec, config, policy, hang
        self.log = log
        self.run_id = run_id
        self.run_dir = run_dir
        self.started_ray = False
        self.reaper: Reaper | None = None  # ends the job's processes if this one is killed
        self.ray_watch: RayWatch | None = None  # Ray's GCS and raylet (planaria.control.ray_health)
        self.drain_watch: NodeDrainWatch | None = None
        self.placement: Placement | None = None
        self.has_pool = False

    def start(self, check_ray: Callable[[], None]) -> None:
        """Ray, the store, the placement group, the pool; ``config.replicas`` workers start
        (:meth:`Membership.wait_ready <planaria.control.membership.Membership.wait_ready>`
        waits for them). ``check_ray`` ends a wait for workers once Ray's processes died."""
        cfg = self.config
        # Before Ray: a controller killed from here on leaves nothing behind
        # (planaria.control.reaper).
        self.reaper = Reaper(self.log.path)
        self.log.add_listener(self.reaper.on_event)
        self.started_ray = startup.init_ray(cfg, self.run_dir, self.reaper)
        self.ray_watch = RayWatch(self.log, owned=self.started_ray)
        if cfg.drain_poll_s is not None:
            self.drain_watch = NodeDrainWatch(cfg.drain_poll_s)
        private = ray_is_private()
        warn_if_gloo_would_use_loopback(cfg, private=private)
        host = store_address(cfg, private=private)
        self.store = host_store(host, timeout_s=60)  # listens on `host` only
        self.store_host = host
        # Each worker connects once: its death is known when its process ends.
        self.lifelines = Lifelines(host)
        self.store.set(store_keys.lifelines(), self.lifelines.address)
        if cfg.placement is not None:
            self.placement = Placement(cfg, name=f"planaria-{self.run_id}")
            self.placement.wait_ready(timeout_s=max(120.0, cfg.join_timeout_s))
            self.log.emit("placement", strategy=self.placement.strategy,
                          bundle=self.placement.bundle, nodes=self.placement.nodes())
        self.liveness = Liveness(self.store, timeout_s=self.hang.heartbeat_timeout_s)
        self.pool = WorkerPool(
            self.spec, cfg, self.hang, self.store, host, self.log,
            max_attempts=self.policy.max_replacement_attempts, placement=self.placement,
            env=worker_env(cfg),
        )
        self.has_pool = True
        self.pool.owner_env = self.reaper.env  # warm workers carry the job's mark
        if self.pool.joiner_memory.enabled:  # a killed controller's regions: the reaper's
            self.reaper.regions(memory_reserve.pattern(self.pool.joiner_memory.tag))
        self.pool.check = check_ray  # a wait for workers ends when Ray's processes die
        cache_file = self.run_dir / CACHE_FILE
        if self.spec.compile and cfg.share_compile_cache and cache_file.exists():
            self.pool.compile_cache = cache_file.read_bytes()  # a resumed job starts warm
        for _ in range(cfg.replicas):
            self.pool.start()

    def learn_from(self, first: WorkerHandle) -> None:
        """What the job's first worker (set up) tells the pool: the dataset's fingerprint
        (replacements must build the same), its compile cache (with
        ``share_compile_cache``); spares start now, once the members are up."""
        assert first.info is not None
        self.pool.data_fingerprint = first.info.data_fingerprint
        if first.info.dataset_draws:  # each worker found it at setup, and loads so
            drawn = list(first.info.dataset_draws)
            processes = self.config.loader_workers
            self.log.emit("dataset_global_rng", generators=drawn,
                          loader_thread=bool(processes) and self.config.prefetch is not False,
                          message=describe_global_draws(drawn, loader_workers=processes))
        if self.spec.compile and self.config.share_compile_cache:
            startup.keep_compile_cache(first, self.pool, self.run_dir, self.log)
        self.pool.replenish()  # spares start once the members are up, never before them

    @property
    def ray_lost(self) -> bool:
        """Ray's GCS or this node's raylet died."""
        return self.ray_watch is not None and self.ray_watch.lost is not None

    def check_ray(self, checkpoints: Checkpoints | None, members: Sequence[WorkerHandle], *,
                  save: bool = False, cause: BaseException | None = None) -> None:
        """Raises RayLost once Ray's GCS or this node's raylet died (planaria.control.ray_health),
        saving the step in hand first with ``save`` where ``members`` all hold it;
        ``cause``: a failure that followed the loss."""
        watch = self.ray_watch
        if watch is not None and watch.lost is not None:
            raise watch.end(checkpoints, members, save=save, cause=cause) from cause

    def close(self, *, checkpointer: Any, members: Sequence[WorkerHandle], ledger: Ledger | None,
              status: str, error: str | None, steps_done: int, t0: float) -> None:
        """Releases, in order: the watches, the checkpointer (its save in flight, its lease),
        the ``members`` and the pool, the placement group, the event log (after
        ``run_end``), the ``ledger``, Ray if the job started it, and what Ray left. Each is
        released whatever the others raised; the first error is raised after all."""
        errors: list[BaseException] = []

        def release(what: str, fn: Callable[[], Any]) -> None:
            try:
                fn()
            except BaseException as err:  # the rest is released all the same
                errors.append(err)
                _mlog.warning("closing the job: %s failed: %s: %s", what, type(err).__name__,
                              err)

        lost = self.ray_lost
        if self.ray_watch is not None:
            release("stopping the Ray watch", self.ray_watch.stop)
        if self.drain_watch is not None:  # a query to a lost GCS would hold the close
            drain_watch = self.drain_watch
            release("stopping the drain watch",
                    lambda: drain_watch.stop(wait_s=0.0 if lost else 5.0))
        if checkpointer is not None:
            release("closing the checkpointer", checkpointer.close)
        if self.has_pool:
            for handle in list(members):
                release(f"releasing {handle.name}", functools.partial(self.pool.release, handle))
            release("stopping the worker pool", self.pool.shutdown)
        if self.placement is not None:
            release("removing the placement group", self.placement.remove)
        if self.lifelines is not None:
            release("closing the lifelines", self.lifelines.close)
        log = self.log
        dropped = {"events": log.dropped, "ledger": ledger.dropped if ledger is not None else 0}
        if any(dropped.values()):
            _mlog.warning("the run directory %s could not take %d event and %d ledger "
                          "records (a full disk?)", self.run_dir, dropped["events"],
                          dropped["ledger"])
        release("writing run_end", lambda: log.emit(
            "run_end", status=status, step=steps_done, wall_s=time.time() - t0,
            error=error, dropped=dropped,
        ))
        release("closing the event log", log.close)
        if ledger is not None:
            release("closing the ledger", ledger.close)
        if self.started_ray or lost:
            # A driver whose GCS or raylet is gone is disconnected too: Ray's C++ would end
            # this process at its reconnect timeout, and Ray's excepthook would wait on the
            # GCS before printing the job's error.
            release("shutting Ray down", ray.shutdown)
        if self.reaper is not None:  # what Ray left (agents whose GCS was gone), then itself
            reaper = self.reaper
            release("sweeping what Ray left", lambda: reaper.sweep(
                session=self.started_ray, marked=self.started_ray or lost))
            release("stopping the reaper", reaper.close)
        if self.has_pool:  # held at the pool's sweep by workers only now killed (Ray lost)
            release("removing the job's shared-memory regions",
                    self.pool.joiner_memory.sweep_left_here)
        if errors:
            raise errors[0]
