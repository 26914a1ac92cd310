"""The controller's pool of worker actors: start, replace with backoff, keep hot spares,
watch, kill."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import ray
import torch.distributed as dist

from planaria.config import RunConfig, TrainSpec
from planaria.control.joiner_memory import JoinerMemory
from planaria.control.placement import Placement
from planaria.control.policy import HangConfig
from planaria.data.integrity import describe_mismatch
from planaria.faults.errors import (
    ConfigError,
    DataMismatch,
    Failure,
    UserCodeError,
    root_cause,
)
from planaria.observe.events import EventLog
from planaria.wire import store_keys
from planaria.wire.state_reports import Setup
from planaria.worker import CONCURRENCY_GROUPS, Worker, forkserver

__all__ = ["StartJudge", "WorkerHandle", "WorkerPool", "start_error", "warm_start_enabled"]


class StartJudge(Protocol):
    """Whose fault a worker's failed start is (planaria.control.blame.judge_start): a failure
    that stops the job (the user's), or None (the worker's: it is started again)."""

    def __call__(self, name: str, cause: BaseException, node: str | None, *,
                 started_any: bool) -> Failure | None: ...


def start_error(err: BaseException) -> str:
    """A failed start's cause, its first lines first (Ray's wrapper and traceback cut), at
    most 2,000 characters."""
    cause = root_cause(err)
    if isinstance(cause, Failure) and cause.args:
        text = f"{type(cause).__name__}: {cause.args[0]}"
    else:
        text = f"{type(cause).__name__}: {cause}"
    return text[:2000]

_log = logging.getLogger("planaria.membership")
# A job runtime_env with one of these runs workers in a Python of its own: no fork server.
_OWN_PYTHON = ("conda", "pip", "uv", "container", "image_uri", "py_executable")


def warm_start_enabled(config: RunConfig) -> bool:
    """Whether workers start through the fork server (``RunConfig.warm_start``)."""
    if config.warm_start is False or not sys.platform.startswith("linux"):
        return False
    job_env = ray.get_runtime_context().runtime_env or {}
    if any(job_env.get(key) for key in _OWN_PYTHON):
        return False
    if config.warm_start:
        return True
    if config.use_gpu:  # not yet measured on a GPU: on there only when asked for
        return False
    return sum(1 for node in ray.nodes() if node.get("Alive")) == 1


@dataclass
class WorkerHandle:
    """One worker actor as the controller sees it."""

    name: str
    actor: Any
    requested_t: float
    replaces: str | None = None
    attempt: int = 1
    setup_ref: Any = None
    ready_t: float | None = None
    info: Setup | None = None  # what it reported once set up
    has_state: bool = False
    receiving: Any = None  # its state arriving beside a step: state_received's reference
    spare: bool = False  # started as a standby worker (see WorkerPool.replenish)
    adopted_t: float | None = None  # when a spare still starting became a replacement

    @property
    def pid(self) -> int | None:
        return None if self.info is None else self.info.pid

    @property
    def node(self) -> str | None:
        """The host it runs on (None until it is set up)."""
        return None if self.info is None else self.info.node

    @property
    def ray_node(self) -> str | None:
        """Ray's id of the node it runs on (None until it is set up)."""
        return None if self.info is None else self.info.ray_node

    @property
    def follower_pids(self) -> tuple[int, ...]:
        """A sharded replica's other workers' pids."""
        return () if self.info is None else tuple(self.info.follower_pids)


class WorkerPool:
    """Starts worker actors and tracks them until they are ready, dead or evicted.

    With ``config.spares`` it also keeps that many standby workers warm (set up, with
    the optimizer state built): a replacement asked for takes a standby at once and
    the next :meth:`poll` hands it over as ready, while a new standby starts in the
    background. A standby is checked alive (one call) before it is handed over. With
    none standing by, a replacement takes a spare still starting (it is further along
    than a new start), and no standby starts while a replacement does: both would
    compete for the same cores or the same free slot, and the replacement is what the
    job waits for (the next standby starts when it is handed over).
    """

    def __init__(
        self,
        spec: TrainSpec,
        config: RunConfig,
        hang: HangConfig,
        store: dist.TCPStore,
        store_host: str,
        log: EventLog,
        *,
        max_attempts: int,
        placement: Placement | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.config = config
        self.hang = hang
        self.store = store
        self.store_host = store_host
        self.log = log
        self.max_attempts = max_attempts
        self.placement = placement
        self.env = dict(env or {})
        self._next_index = 0
        self.starting: list[WorkerHandle] = []
        self.standby: list[WorkerHandle] = []  # warm spares, ready to take a place
        self._handed: list[WorkerHandle] = []  # spares taken, handed over by the next poll
        self.last_start_error: str | None = None
        self._retry_at: list[tuple[float, WorkerHandle]] = []
        self.local_node = socket.gethostname()
        self.data_fingerprint: Mapping[str, object] | None = None  # the job's, once it has started
        self.compile_cache: bytes | None = None  # a running worker's (spec.compile), for new ones
        # Two lanes: steps and state in the default one, stack dumps (mid-step) in "control".
        remote: Any = ray.remote
        self._actor_cls = remote(concurrency_groups=CONCURRENCY_GROUPS)(Worker)
        # A sharded replica's leader hands the spec to its other workers as pickled here.
        self._spec_blob = (ray.cloudpickle.dumps(spec) if config.workers_per_replica > 1
                           else None)
        self.warm_start = warm_start_enabled(config)
        # the job's mark (planaria.control.reaper), warm workers'
        self.owner_env: dict[str, str] = {}
        self.check: Callable[[], None] | None = None  # raises to end a wait (Ray's loss)
        self.judge_start: StartJudge | None = None  # whose fault a failed start is
        self.started_any = False  # a worker of this job has started: its factories work
        self.joiner_memory = JoinerMemory(config.joiner_memory_reserve)

    def start(
        self,
        *,
        replaces: str | None = None,
        attempt: int = 1,
        name: str | None = None,
        spare: bool = False,
    ) -> WorkerHandle:
        """Asks Ray for a new worker; it builds its model in the background. A replacement
        takes a warm spare instead when one is standing by."""
        if replaces is not None and attempt == 1:
            taken = self._take_spare(replaces)
            if taken is not None:
                return taken
        if name is None:
            name = f"w{self._next_index}"
            self._next_index += 1
        cfg = self.config
        where: dict[str, Any] = {}
        if self.placement is not None:
            where.update(self.placement.options(name))
        runtime_env: dict[str, Any] = {}
        if self.env:
            runtime_env["env_vars"] = dict(self.env)
        joiner = replaces is not None or spare
        if self.warm_start and attempt == 1:  # a retry starts cold, whatever failed
            runtime_env["py_executable"] = forkserver.py_executable()
            # The fork server and its workers are the job's: its reaper kills them.
            runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **self.owner_env}
            if joiner and cfg.joiner_setup_priority == "idle":  # its start beside the steps
                runtime_env["env_vars"][forkserver.START_PRIORITY_VAR] = "idle"
            if not cfg.use_gpu:  # its death heard before its memory is torn down
                holder = os.environ.get(forkserver.MEMORY_HOLDER_VAR, "1")  # "0": off
                runtime_env["env_vars"].setdefault(forkserver.MEMORY_HOLDER_VAR, holder)
        if runtime_env:
            where["runtime_env"] = runtime_env
        resources: dict[str, Any] = {
            "num_cpus": cfg.cpus_per_worker,
            "num_gpus": cfg.gpus_per_worker if cfg.use_gpu else 0,
        }
        follower: dict[str, Any] = dict(resources)
        if "runtime_env" in where:
            follower["runtime_env"] = where["runtime_env"]
        actor = self._actor_cls.options(
            max_restarts=0,
            max_concurrency=1,
            **resources,
            **where,
        ).remote(
            name,
            self.spec,
            self.store_host,
            self.store.port,
            threads=cfg.threads,
            heartbeat_s=self.hang.heartbeat_s,
            use_gpu=cfg.use_gpu,
            backend=cfg.process_group_backend,
            record_digests=cfg.ledger,
            overlap_reduction=cfg.overlap_reduction,
            keep_finished=cfg.keep_finished_micro_batches,
            prefetch=cfg.prefetch,
            loader_workers=cfg.loader_workers,
            workers_per_replica=cfg.workers_per_replica,
            # Unique per start: a replacement under the same name meets its own replica.
            replica_key=f"{name}-{attempt}-{time.monotonic_ns()}",
            follower_options=follower,
            timeouts=(cfg.join_timeout_s, cfg.collective_timeout_s),
            spec_blob=self._spec_blob,
        )
        handle = WorkerHandle(name, actor, time.time(), replaces=replaces, attempt=attempt,
                              spare=spare)
        handle.setup_ref = actor.setup.remote(
            joiner=joiner, skip_init=joiner and cfg.joiner_skips_init,
            compile_cache=self.compile_cache,
            priority=cfg.joiner_setup_priority if joiner else "worker",
            reserve=self.joiner_memory.claimed())
        self.starting.append(handle)
        if replaces is not None and attempt == 1:
            self.log.emit("replacement_requested", worker=name, replaces=replaces)
        if spare and attempt == 1:
            self.log.emit("spare_requested", worker=name)
        return handle

    # ---- hot spares --------------------------------------------------------------------------

    @property
    def spares_starting(self) -> int:
        return sum(h.spare for h in self.starting) + sum(h.spare for _, h in self._retry_at)

    @property
    def replacements_starting(self) -> int:
        return sum(h.replaces is not None for h in self.starting) + sum(
            h.replaces is not None for _, h in self._retry_at)

    def replenish(self) -> None:
        """Starts standby workers until ``config.spares`` are standing by or starting;
        none while a replacement is starting (:meth:`poll` calls again once it is ready)."""
        if self.replacements_starting:
            return
        for _ in range(self.config.spares - len(self.standby) - self.spares_starting):
            self.start(spare=True)

    def _take_spare(self, replaces: str) -> WorkerHandle | None:
        """The first standby that still answers, now a replacement for ``replaces``; else
        the spare that started first and is still starting (:meth:`_adopt_starting`)."""
        while self.standby:
            handle = self.standby.pop(0)
            try:  # a standby sits idle, so a death there is only seen when it is asked
                ray.get(handle.actor.alive.remote(), timeout=5.0)
            except Exception as err:
                self.log.emit("spare_lost", worker=handle.name, error=str(err)[:300])
                self.kill(handle, fence=False)
                continue
            now = time.time()
            waited = now - (handle.ready_t or now)
            handle.replaces, handle.requested_t, handle.ready_t = replaces, now, now
            handle.spare = False  # a replacement from now on
            self.log.emit("replacement_requested", worker=handle.name, replaces=replaces,
                          spare=True)
            self.log.emit("replacement_ready", worker=handle.name, replacement_s=0.0,
                          spare=True, standby_s=waited)
            self._handed.append(handle)
            self.replenish()
            return handle
        return self._adopt_starting(replaces)  # standbys lost here: made up for by poll

    def _adopt_starting(self, replaces: str) -> WorkerHandle | None:
        """A spare still starting, now the replacement for ``replaces``: :meth:`poll` hands
        it over when its setup ends (a spare's and a replacement's setup are the same)."""
        handle = next((h for h in self.starting if h.spare), None)
        if handle is None:
            return None
        handle.spare, handle.replaces, handle.adopted_t = False, replaces, time.time()
        self.log.emit("replacement_requested", worker=handle.name, replaces=replaces,
                      spare=True, starting=True)
        return handle

    def has_ready(self) -> bool:
        """A worker would be handed over by :meth:`poll` now (a replacement finished starting,
        a spare was taken, or a failed start is due for a retry). Consumes nothing."""
        if self._handed or any(due <= time.time() for due, _ in self._retry_at):
            return True
        refs = [h.setup_ref for h in self.starting if not h.spare]
        return bool(refs) and bool(ray.wait(refs, num_returns=1, timeout=0.0)[0])

    def poll(self, timeout_s: float = 0.0) -> list[WorkerHandle]:
        """Workers that became ready within ``timeout_s``; failed starts are retried with backoff.

        A start that fails in the user's own factories raises UserCodeError, one whose
        dataset cannot run (a stream) ConfigError: retrying cannot help. A worker whose
        dataset differs from the job's is refused (killed) and raises DataMismatch: it
        would poison the training.
        Raises what :attr:`check` raises (Ray's own processes died: none can start).
        """
        if self.check is not None:
            self.check()
        now = time.time()
        for due, old in list(self._retry_at):
            if due <= now:
                self._retry_at.remove((due, old))
                self.start(replaces=old.replaces, attempt=old.attempt + 1, name=old.name,
                           spare=old.spare)
        ready, self._handed = self._handed, []
        if not self.starting:
            return ready
        refs = [h.setup_ref for h in self.starting]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0.0 if ready else timeout_s)
        for handle in [h for h in self.starting if h.setup_ref in done]:
            self.starting.remove(handle)
            try:
                info: Setup = ray.get(handle.setup_ref)
            except Exception as err:
                cause = getattr(err, "cause", None) or err
                if isinstance(cause, UserCodeError):
                    cause.workers = (handle.name,)
                    raise cause from None
                if isinstance(cause, ConfigError):  # what the worker built cannot run
                    raise cause from None
                # Each start is a worker of its own: a start again failing as the one
                # before failed is the factories' as much as another worker's would be.
                label = handle.name if handle.attempt == 1 else (
                    f"{handle.name} (start {handle.attempt})")
                stop = None if self.judge_start is None else self.judge_start(
                    label, cause, handle.ray_node, started_any=self.started_any)
                self._failed_start(handle, err, retry=stop is None)
                if stop is not None:
                    raise stop from None
                continue
            self.started_any = True
            handle.info = info
            if self.joiner_memory.enabled:
                self.joiner_memory.note(info.ray_node)
            self._check_data(handle)
            handle.ready_t = time.time()
            ready_s = handle.ready_t - handle.requested_t
            start = dict(info.start)
            # Two clocks when the worker is on another node.
            start["process_s"] = max(0.0, info.init_t - handle.requested_t)
            self.log.emit(
                "worker_started",
                worker=handle.name,
                pid=info.pid,
                node=info.node,
                ray_node=info.ray_node,
                ready_s=ready_s,
                follower_pids=list(info.follower_pids) or None,
                warm=self.compile_cache is not None if self.spec.compile else None,
                **start,
            )
            if handle.spare:
                self.standby.append(handle)
                self.log.emit("spare_ready", worker=handle.name, ready_s=ready_s)
                continue
            if handle.replaces is not None:  # an adopted spare: from its adoption
                adopted = {} if handle.adopted_t is None else {"spare": True}
                self.log.emit("replacement_ready", worker=handle.name, **adopted,
                              replacement_s=handle.ready_t - (handle.adopted_t
                                                              or handle.requested_t))
            ready.append(handle)
        if any(h.replaces is not None for h in ready):
            self.replenish()  # held back while the replacement started
        return ready

    def _check_data(self, handle: WorkerHandle) -> None:
        info = handle.info
        if self.data_fingerprint is None or info is None:
            return  # the job compares its first workers with each other
        problem = describe_mismatch(
            {"the job": self.data_fingerprint, handle.name: info.data_fingerprint}
        )
        if problem is None:
            return
        self.kill(handle)
        self.log.emit("worker_refused", worker=handle.name, reason=problem)
        _log.error("%s refused: %s", handle.name, problem)
        raise DataMismatch(
            f"{handle.name} built a different dataset from the job's ({problem}); it was "
            "refused: make the dataset factory deterministic (it runs with random, numpy and "
            "torch seeded from spec.seed) and read the same files on every node"
        )

    def _failed_start(self, handle: WorkerHandle, err: BaseException, *, retry: bool) -> None:
        self.last_start_error = f"{handle.name}: {start_error(err)}"
        self.kill(handle, fence=False)  # a half-started actor holds CPUs, maybe a GPU
        self.log.emit("replacement_failed", worker=handle.name, attempt=handle.attempt,
                      error=start_error(err))
        if not retry:
            return
        if handle.attempt >= self.max_attempts:
            _log.error("%s failed to start %d times; giving up on it", handle.name, handle.attempt)
            return
        backoff = min(30.0, 0.5 * 2 ** (handle.attempt - 1))
        self._retry_at.append((time.time() + backoff, handle))

    def drop_spares_on(self, nodes: set[str]) -> list[str]:
        """Releases the standby spares on draining Ray nodes (they would leave with them) and
        starts others in their place; returns their names."""
        gone = [h for h in self.standby if h.ray_node in nodes]
        for handle in gone:
            self.standby.remove(handle)
            self.log.emit("spare_lost", worker=handle.name, error="its Ray node is draining")
            self.release(handle)
        if gone:
            self.replenish()
        return [h.name for h in gone]

    @property
    def pending_count(self) -> int:
        """Replacements on their way (spares starting for the standby do not count)."""
        return (len(self._handed) + len(self.starting) + len(self._retry_at)
                - self.spares_starting)

    def stack(self, handle: WorkerHandle, timeout_s: float = 1.0) -> str | None:
        """The worker's Python stacks if it still answers within the deadline."""
        try:
            return str(ray.get(handle.actor.dump_stack.remote(), timeout=timeout_s))
        except Exception:
            return None

    def fence(self, name: str) -> None:
        """Marks a worker evicted: if it ever wakes up, its heartbeat thread makes it exit
        (the other workers of its replica too, with ``workers_per_replica`` > 1)."""
        self.store.set(store_keys.fence(name), "1")
        for i in range(1, self.config.workers_per_replica):
            self.store.set(store_keys.fence(f"{name}.{i}"), "1")

    def kill(self, handle: WorkerHandle, *, fence: bool = True) -> None:
        """Evicts a worker: fences it off, then kills its process."""
        if fence:
            self.fence(handle.name)
        if self.placement is not None:
            self.placement.free(handle.name)
        pids = [handle.pid, *handle.follower_pids]
        if handle.node == self.local_node:
            for pid in pids:  # a sharded replica's own workers run on the leader's node
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)  # works on a SIGSTOP'ed process too
        with contextlib.suppress(Exception):
            ray.kill(handle.actor, no_restart=True)

    def release(self, handle: WorkerHandle) -> None:
        """Ends a healthy worker (at the end of a job, or one not needed)."""
        if self.placement is not None:
            self.placement.free(handle.name)
        with contextlib.suppress(Exception):
            ray.kill(handle.actor, no_restart=True)

    def shutdown(self) -> None:
        for handle in self.starting:
            self.kill(handle, fence=False)
        for handle in self.standby + self._handed:
            self.release(handle)
        self.starting.clear()
        self.standby.clear()
        self._handed.clear()
        self._retry_at.clear()
        self.joiner_memory.sweep()
