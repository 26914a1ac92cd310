"""Starting a job: its configuration checked, Ray started (or joined), the compile cache
kept for the workers started later."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import ray
import torch

from planaria._version import __version__
from planaria.backoff import retry
from planaria.control.evaluation import check_eval_config
from planaria.faults.errors import ConfigError
from planaria.worker.compile_cache import CACHE_FILE

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from planaria.config import RunConfig, TrainSpec
    from planaria.control.policy import RecoveryPolicy
    from planaria.control.pool import WorkerHandle, WorkerPool
    from planaria.observe.events import EventLog

__all__ = [
    "ProcessMarker", "check_config", "describe", "init_ray", "keep_compile_cache",
    "log_run_start",
]

_log = logging.getLogger("planaria.commits")
_mlog = logging.getLogger("planaria.membership")

RAY_START_ATTEMPTS = 3
"""Tries at starting a local Ray node (its start can time out on a loaded machine)."""
NO_PRESTART = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
"""Ray's system config for a local node: no generic worker processes started ahead."""


class ProcessMarker(Protocol):
    """Marks the processes started under ``marking()`` as the job's, and adopts a Ray
    session's processes (``session(dir)``), so that they end with the job
    (:class:`~planaria.control.reaper.Reaper`)."""

    def marking(self) -> AbstractContextManager[Any]: ...

    def session(self, session_dir: str) -> None: ...


def log_run_start(log: EventLog, run_id: str, spec: TrainSpec, config: RunConfig,
                  policy: RecoveryPolicy, *, resume: bool) -> None:
    """The event log's first record: what the job is; ``resume``: whether it continues the
    job the run dir's previous runs trained (it resumes their checkpoints) rather than
    starting a new one (planaria.observe.segments.split_runs)."""
    log.emit(
        "run_start", run_id=run_id, resume=resume, replicas=config.replicas, steps=config.steps,
        start_step=None,  # known once a checkpoint is (or is not) resumed: see `restore`
        global_batch_size=spec.global_batch_size, micro_batch_size=spec.micro_batch_size,
        seed=spec.seed, num_samples=None, config=describe(config, policy),
        planaria_version=__version__, torch_version=torch.__version__,
    )


def check_config(spec: TrainSpec, config: RunConfig, policy: RecoveryPolicy) -> None:
    """Raises ConfigError for a job that cannot run as configured."""
    if policy.min_replicas > config.replicas:
        raise ConfigError(
            f"min_replicas={policy.min_replicas} is not valid: it must be <= "
            f"replicas={config.replicas}"
        )
    micro_batches = spec.global_batch_size // spec.micro_batch_size
    _check_sharded(spec, config, micro_batches)
    check_eval_config(spec, config)
    if spec.forward_backward is not None and config.overlap_reduction:
        raise ConfigError(
            "overlap_reduction=True is not valid with spec.forward_backward: the overlapped "
            "reduction starts during a micro-batch's one backward, and a forward_backward may "
            "call backward several times; use overlap_reduction=False, or TrainSpec(loss=...)"
        )
    if config.replicas > micro_batches:
        raise ConfigError(
            f"replicas={config.replicas} is not valid: a rank runs whole micro-batches and "
            f"the global batch has {micro_batches} (global_batch_size="
            f"{spec.global_batch_size} / micro_batch_size={spec.micro_batch_size}): use at "
            f"most {micro_batches} replicas, a smaller micro_batch_size or a larger "
            "global_batch_size"
        )


def init_ray(config: RunConfig, run_dir: Path, reaper: ProcessMarker) -> bool:
    """Starts a local Ray node, or joins the cluster at ``config.address`` (or
    ``RAY_ADDRESS``); nothing if Ray is up already. Returns whether it started Ray."""
    if ray.is_initialized():
        return False
    cfg = config
    address = cfg.address or os.environ.get("RAY_ADDRESS")  # a RayJob's driver has it set
    if address:
        ray.init(address=address, **cfg.ray_init_kwargs)
        return False
    from planaria.observe.ray_logs import route_ray_logs

    route_ray_logs(run_dir)  # Ray's notices go to RUN_DIR/ray.log, planaria's to you
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
    # planaria's workers start from their own interpreter (a runtime_env's py_executable,
    # planaria.worker.forkserver), so the generic workers Ray starts ahead for a driver
    # never serve one: they would only take CPU from the training (~1 % of a core each).
    kwargs["_system_config"] = {**NO_PRESTART, **kwargs.get("_system_config", {})}

    def start() -> None:
        with reaper.marking():  # the session's processes are the job's
            ray.init(**kwargs)

    # A local node that did not come up in time (a loaded machine): its half-started
    # processes go, and it is started again. Ray raises a bare Exception for that.
    retry(start, what="starting Ray's local node", attempts=RAY_START_ATTEMPTS,
          retryable=lambda err: "timed out during startup" in str(err),
          backoff_s=2.0, log=_mlog, on_retry=lambda err: ray.shutdown())
    route_ray_logs(run_dir)
    node: Any = ray._private.worker._global_node
    reaper.session(node.get_session_dir_path())
    return True


def keep_compile_cache(source: WorkerHandle, pool: WorkerPool, run_dir: Path,
                       log: EventLog) -> None:
    """Takes ``source``'s compile cache (it compiled in its setup) for the workers started
    later, and saves it in the run directory (atomically) for a resumed job."""
    try:
        data = ray.get(source.actor.compile_cache.remote(), timeout=120)
    except Exception as err:  # no cache: workers started later compile from scratch
        _log.warning("could not take %s's compile cache: %r", source.name, err)
        return
    if not data:
        return
    pool.compile_cache = data
    tmp = run_dir / f"{CACHE_FILE}.tmp"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, run_dir / CACHE_FILE)
    except OSError as err:  # a full run dir: the workers started later still get it
        _log.warning("could not keep the compile cache in %s: %s", run_dir, err)
        tmp.unlink(missing_ok=True)
    log.emit("compile_cache", worker=source.name, bytes=len(data))


def describe(cfg: RunConfig, policy: RecoveryPolicy) -> dict[str, Any]:
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
