"""The controller: one long-lived process that drives the workers, run by run.

:class:`Job` is a facade over the controller's parts (:mod:`planaria.control`): the
membership, the calls, the commit log, the step boundary and its planner, the
replica check; what to do about a failure lives in :mod:`planaria.control.recovery`.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from planaria.checkpoint.config import CheckpointConfig
from planaria.checkpoint.coordinator import Checkpointer, save_under
from planaria.config import RunConfig, TrainSpec
from planaria.control import startup
from planaria.control.attribution import Attribution
from planaria.control.calls import Calls
from planaria.control.checkpoint_view import CheckpointView
from planaria.control.commit_log import CommitLog, StepResult
from planaria.control.departures import Departures
from planaria.control.evaluation import Evaluation
from planaria.control.facade import Delegated
from planaria.control.hooks import FaultHooks
from planaria.control.membership import Membership
from planaria.control.policy import HangConfig, RecoveryPolicy
from planaria.control.pool import WorkerHandle
from planaria.control.protocols import Checkpoints
from planaria.control.recovery import Recovery
from planaria.control.runtime import Runtime
from planaria.control.watchdog import StepDeadline
from planaria.control.wiring import Parts, assemble, connect_calls
from planaria.data.plan import DataPlan, Ledger
from planaria.faults.chaos import ChaosPlan
from planaria.faults.errors import ConfigError, ElasticRuntimeError, Failure, PlanariaError
from planaria.observe.events import EventLog
from planaria.observe.loss_history import LossHistory
from planaria.wire.evaluation import EvalResult

__all__ = ["Job", "StepResult"]

_mlog = logging.getLogger("planaria.membership")
NOT_STARTED = "the job is not started: use it as a context manager"


class Job:
    """A training job: the controller side of planaria.

    Use as a context manager; :meth:`run_steps` runs steps up to a count (:meth:`train_step`
    one) and raises a :class:`~planaria.faults.errors.Failure` when one goes wrong;
    ``job.recovery.handle(failure)`` applies the policy to it (see
    :mod:`planaria.control.recovery`).
    """

    def __init__(
        self, spec: TrainSpec, config: RunConfig, *, policy: RecoveryPolicy | None = None,
        hang: HangConfig | None = None, chaos: ChaosPlan | None = None,
        checkpoint: CheckpointConfig | None = None,
        listeners: Sequence[Callable[[dict[str, Any]], None]] = (),
    ) -> None:
        self.spec, self.config = spec, config
        self.policy = policy or RecoveryPolicy()
        self.hang = hang or HangConfig()
        self.chaos = chaos
        self.checkpoint_config = checkpoint
        self.checkpointer: Checkpointer | None = None  # with checkpoints on
        self.checkpoint_view: CheckpointView | None = None  # the job, as checkpoints see it
        startup.check_config(spec, config, self.policy)
        self.run_dir = config.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = EventLog(self.run_dir)
        for listener in listeners:  # progress display, Prometheus, logging
            self.log.add_listener(listener)
        self.run_id = uuid.uuid4().hex[:12]
        self.deadline = StepDeadline(self.hang)
        self.attribution = Attribution()  # the work's fault or the worker's
        self.commit_log = CommitLog(log=self.log, deadline=self.deadline,
                                    micro_batch_size=spec.micro_batch_size, run_id=self.run_id,
                                    ledger_dir=self.run_dir if config.ledger else None)
        self.fault_hooks = FaultHooks(self)  # hook(job, phase, **info): see FaultHooks
        self.membership = Membership(config=config, log=self.log, deadline=self.deadline,
                                     commit_log=self.commit_log, hooks=self.fault_hooks)
        self.departures = Departures()
        self.runtime = Runtime(spec=spec, config=config, policy=self.policy, hang=self.hang,
                               log=self.log, run_id=self.run_id, run_dir=self.run_dir)
        self.calls: Calls | None = None  # once the store is up
        self.parts: Parts | None = None  # the rest of the controller, once started
        self._t0 = time.time()
        self.closed = False
        self.started = False

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
        cfg, spec = self.config, self.spec
        resume = self.checkpoint_config is not None and self.checkpoint_config.resume
        startup.log_run_start(self.log, self.run_id, spec, cfg, self.policy, resume=resume)
        rt = self.runtime
        rt.start(self.check_ray)
        self.store, self.store_host, self.liveness, self.pool = (rt.store, rt.store_host,
                                                                 rt.liveness, rt.pool)
        self.calls, fault_times = connect_calls(
            runtime=rt, membership=self.membership, deadline=self.deadline, hang=self.hang,
            attribution=self.attribution, log=self.log, departures=self.departures)
        first = self.membership.start_members(timeout_s=max(120.0, cfg.join_timeout_s))
        rt.learn_from(first)  # the dataset's fingerprint, the compile cache; spares start
        assert first.info is not None
        self.commit_log.plan = DataPlan(first.info.num_samples, spec.global_batch_size,
                                        spec.seed)
        self.started = True
        view = self.checkpoint_view = CheckpointView(
            membership=self.membership, calls=self.calls, commit_log=self.commit_log,
            log=self.log, hooks=self.fault_hooks, run_dir=self.run_dir)
        checkpoints: Checkpoints | None = None  # the Checkpointer, as the parts see it
        if self.checkpoint_config is not None:
            ck = Checkpointer(view, self.checkpoint_config)
            ck.on_start()
            self.checkpointer = checkpoints = ck
        self.parts = assemble(
            spec=spec, config=cfg, policy=self.policy, hang=self.hang, log=self.log, runtime=rt,
            membership=self.membership, commit_log=self.commit_log, departures=self.departures,
            fault_times=fault_times, hooks=self.fault_hooks, attribution=self.attribution,
            deadline=self.deadline, calls=self.calls, checkpoints=checkpoints,
            chaos=self.chaos, elapsed_s=lambda: self.elapsed_s)
        view.counts = self.parts.recovery
        self.build_generation(self.members, reason="start")
        if self.checkpointer is not None:
            try:
                self.checkpointer.resume_if_asked()
            except Failure as failure:  # a worker died while resuming: recover as from any
                self.recovery.handle(failure)

    def close(self, *, status: str = "ok", error: str | None = None) -> None:
        """Releases everything the job holds, in order (see Runtime.close); the first error
        is raised once all is released."""
        if self.closed:
            return
        self.closed = True
        self.runtime.close(checkpointer=self.checkpointer, members=self.members,
                           ledger=self.ledger, status=status, error=error,
                           steps_done=self.steps_done, t0=self._t0)

    def check_ray(self, *, save: bool = False, cause: BaseException | None = None) -> None:
        """Raises RayLost once Ray's GCS or this node's raylet died (planaria.control.ray_health),
        saving the step in hand first with ``save``; ``cause``: a failure that followed."""
        self.runtime.check_ray(self.checkpointer, self.members, save=save, cause=cause)

    def train_step(self) -> StepResult:
        """Runs the next step and commits it, or raises a Failure (``job.recovery.handle``
        applies the policy to it): a run of one step, with ``fit``'s protocol, commit and
        ledger."""
        return self.run_steps(self.steps_done + 1)[-1]

    def run_steps(self, until: int) -> list[StepResult]:
        """Runs steps up to ``until`` (at least one, up to the next boundary where the
        controller must act) and commits them, or raises a Failure (recover from it as
        from train_step's)."""
        parts = self._parts()
        parts.step_boundary.boundary()
        start = self.steps_done
        stop = parts.planner.next_boundary(start, until, open_work=parts.recovery.open_work(),
                                           metrics_known=self.commit_log.metric_keys is not None)
        return parts.run_ahead.run(stop)

    def evaluate(self) -> EvalResult:
        """Evaluates the committed state now on ``spec.eval_dataset``, split over the live
        replicas, and records it (see :mod:`planaria.control.evaluation`); raises a Failure
        if a worker fails meanwhile (recover from it as from a step's, then evaluate again)."""
        return self._parts().evaluation.evaluate()

    def boundary(self) -> None:
        """What happens between runs: joins, drains, saves, chaos (see StepBoundary)."""
        self._parts().step_boundary.boundary()

    def wait_for_width(self, width: int, *, timeout_s: float) -> int:
        """Waits at a step boundary, admitting replacements as they become ready, until
        ``width`` replicas are live or ``timeout_s`` has passed; returns the width reached.
        Training does not advance meanwhile; a Failure meanwhile is raised (recover from it
        as from a step's)."""
        return self.membership.wait_for_width(width, timeout_s=timeout_s,
                                              admit=self._parts().recovery.admit)

    def wait_for_spares(self, *, timeout_s: float) -> int:
        """Waits until ``config.spares`` standby workers are warm (they start with the job)
        or ``timeout_s`` has passed; returns how many stand by."""
        return self.membership.wait_for_spares(timeout_s=timeout_s,
                                               admit=self._parts().recovery.admit)

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The committed training state, from rank 0 (tensors on the CPU, metadata)."""
        return self.membership.state()

    def save(self, root: str | None = None,
             storage_options: dict[str, Any] | None = None) -> str:
        """Saves the committed state now and waits for the commit; returns the checkpoint's
        path. ``root`` None: the job's checkpoint root; another root (a path every worker
        reaches, ``s3://...``, with its ``storage_options``): saved there in this run's
        lineage, so that a job given that root resumes from it; also what to do after a
        FinalSaveFailed. Raises CheckpointError if the save does not commit, a Failure if a
        worker fails meanwhile (recover from it as from a step's)."""
        if not self.started or self.closed or self.checkpoint_view is None:
            raise ElasticRuntimeError("Job.save needs a started job that is not closed")
        if self.checkpointer is None:
            if root is None:
                raise ConfigError(
                    "root=None is not valid: this job has no checkpoint root (checkpoint="
                    "None); give Job.save a root, or the job CheckpointConfig(...)"
                )
            return save_under(self.checkpoint_view, root, storage_options)
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
        return self._parts().replicas.checksums()

    def verify_replicas(self) -> None:
        """Compares the replicas' parameter checksums; raises ReplicaDivergence naming those
        that differ from a strict majority (the recovery treats them as lost)."""
        self._parts().replicas.verify()

    def _parts(self) -> Parts:
        if self.parts is None:
            raise ElasticRuntimeError(NOT_STARTED)
        return self.parts

    def gather(self, refs: dict[str, Any], *, deadline_s: float, step: int | None,
               poll: Callable[[], None] | None = None) -> dict[str, Any]:
        """Waits for one call per worker (see :class:`~planaria.control.calls.Calls`)."""
        if self.calls is None:
            raise ElasticRuntimeError(NOT_STARTED)
        return self.calls.gather(refs, deadline_s=deadline_s, step=step, poll=poll)

    def hook(self, phase: str, **info: Any) -> None:
        """Calls the hooks at a named phase (see :class:`~planaria.control.hooks.FaultHooks`)."""
        self.fault_hooks.call(phase, **info)

    def build_generation(self, members: list[WorkerHandle], *, reason: str) -> None:
        self.membership.build_generation(members, reason=reason)

    def evict(self, names: Sequence[str], *, kill: bool = True) -> None:
        self.membership.evict(names, kill=kill)

    def commit_all(self) -> None:
        """Makes every worker apply the committed steps now (before a snapshot or the end)."""
        self.membership.commit_all()

    @property
    def recovery(self) -> Recovery:
        return self._parts().recovery

    @property
    def evaluation(self) -> Evaluation:
        """The evaluations: ``results`` (one per step, in step order), ``if_due()``."""
        return self._parts().evaluation

    @property
    def hooks(self) -> list[Callable[..., None]]:
        """hook(job, phase, **info), called at named phases: see FaultHooks."""
        return self.fault_hooks.hooks

    @property
    def steps_done(self) -> int:
        """Steps committed: the commit log's (a checkpoint's restore sets it, see
        CommitLog.restart_at)."""
        return self.commit_log.steps_done

    @steps_done.setter
    def steps_done(self, step: int) -> None:
        self.commit_log.restart_at(step)

    members = Delegated[list[WorkerHandle]]("membership")  # rank order
    gen = Delegated[int]("membership")
    width = Delegated[int]("membership")
    names = Delegated[list[str]]("membership")
    plan = Delegated[DataPlan | None]("commit_log")
    ledger = Delegated[Ledger | None]("commit_log")
    losses = Delegated[LossHistory]("commit_log")
    skipped_samples = Delegated[set[int]]("commit_log")

    @property
    def elapsed_s(self) -> float:
        return time.time() - self._t0
