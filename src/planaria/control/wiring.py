"""The controller's parts, put together: who receives which seam (the composition root
:class:`~planaria.control.job.Job` calls)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planaria.control.blame import judge_start
from planaria.control.boundary import BoundaryPlanner, StepBoundary
from planaria.control.calls import Calls
from planaria.control.carry_plan import HeldSteps
from planaria.control.chaos_injection import ChaosInjector
from planaria.control.departures import FaultTimes
from planaria.control.evaluation import Evaluation
from planaria.control.notices import Notices
from planaria.control.recovery import Recovery
from planaria.control.replicas import ReplicaCheck
from planaria.control.run_ahead import RunAhead

if TYPE_CHECKING:
    from planaria.config import RunConfig, TrainSpec
    from planaria.control.attribution import Attribution
    from planaria.control.commit_log import CommitLog
    from planaria.control.departures import Departures
    from planaria.control.hooks import FaultHooks
    from planaria.control.membership import Membership
    from planaria.control.policy import HangConfig, RecoveryPolicy
    from planaria.control.protocols import Checkpoints
    from planaria.control.runtime import Runtime
    from planaria.control.watchdog import StepDeadline
    from planaria.faults.chaos import ChaosPlan
    from planaria.observe.events import EventLog

__all__ = ["Parts", "assemble", "connect_calls"]


@dataclass(frozen=True, kw_only=True)
class Parts:
    """A started job's parts beyond its membership and commit log."""

    calls: Calls
    replicas: ReplicaCheck
    notices: Notices
    planner: BoundaryPlanner
    chaos: ChaosInjector | None
    run_ahead: RunAhead
    recovery: Recovery
    step_boundary: StepBoundary
    evaluation: Evaluation


def connect_calls(*, runtime: Runtime, membership: Membership, deadline: StepDeadline,
                  hang: HangConfig, attribution: Attribution, log: EventLog,
                  departures: Departures) -> tuple[Calls, FaultTimes]:
    """The calls to the workers, once the store and the pool are up; the membership
    starts, waits on and judges its calls through them."""
    fault_times = FaultTimes(runtime.liveness.last_alive_t)
    calls = Calls(roster=membership, store=runtime.store, liveness=runtime.liveness,
                  deadline=deadline, hang=hang, attribution=attribution, pool=runtime.pool,
                  log=log, departures=departures, fault_times=fault_times,
                  exits=runtime.lifelines)
    membership.connect(runtime.pool, calls)
    runtime.pool.judge_start = functools.partial(judge_start, attribution=attribution)
    return calls, fault_times


def assemble(
    *, spec: TrainSpec, config: RunConfig, policy: RecoveryPolicy, hang: HangConfig,
    log: EventLog, runtime: Runtime, membership: Membership, commit_log: CommitLog,
    departures: Departures, fault_times: FaultTimes, hooks: FaultHooks,
    attribution: Attribution, deadline: StepDeadline, calls: Calls,
    checkpoints: Checkpoints | None, chaos: ChaosPlan | None, elapsed_s: Callable[[], float],
) -> Parts:
    """Every other part, once the checkpoints are known (None: off)."""
    pool, drain_watch = runtime.pool, runtime.drain_watch

    def check_ray(*, save: bool = False, cause: BaseException | None = None) -> None:
        runtime.check_ray(checkpoints, membership.members, save=save, cause=cause)

    draining_nodes = drain_watch.draining if drain_watch is not None else None
    replicas = ReplicaCheck(membership=membership, calls=calls, commit_log=commit_log, log=log,
                            verify_every=config.verify_every)
    notices = Notices(store=runtime.store, roster=membership, departures=departures,
                      fault_times=fault_times, log=log, steps=commit_log,
                      checkpoints=checkpoints, pool=pool, draining_nodes=draining_nodes,
                      abort_generation=calls.abort_generation)
    planner = BoundaryPlanner(
        roster=membership, hooks=hooks, checkpoints=checkpoints, chaos=chaos,
        replicas=config.replicas, verify_every=config.verify_every,
        replacements_ready=pool.has_ready, draining_nodes=draining_nodes,
        ray_lost=lambda: runtime.ray_lost, elapsed_s=elapsed_s, eval_every=config.eval_every)
    injector = (ChaosInjector(plan=chaos, roster=membership, fault_times=fault_times, log=log,
                              deadline=deadline, elapsed_s=elapsed_s)
                if chaos is not None else None)
    run_ahead = RunAhead(membership=membership, calls=calls, commit_log=commit_log,
                         planner=planner, notices=notices, departures=departures,
                         chaos=injector, store=runtime.store, liveness=runtime.liveness,
                         log=log, hang=hang, horizon=config.steps,
                         held=HeldSteps(spec.global_batch_size // spec.micro_batch_size))
    recovery = Recovery(policy=policy, spec=spec, replicas=config.replicas,
                        membership=membership, calls=calls, commit_log=commit_log,
                        notices=notices, departures=departures, fault_times=fault_times,
                        attribution=attribution, checkpoints=checkpoints,
                        saved_steps=run_ahead, log=log, check_ray=check_ray)
    commit_log.on_commit = recovery.on_commit
    evaluation = Evaluation(spec=spec, roster=membership, calls=calls, steps=commit_log,
                            commit_all=membership.commit_all, log=log,
                            eval_every=config.eval_every)
    step_boundary = StepBoundary(
        check_ray=check_ray, verify_if_due=replicas.verify_if_due, hooks=hooks,
        poll_ready=lambda: pool.poll(timeout_s=0.0), policy=recovery, notices=notices,
        checkpoints=checkpoints, chaos=injector, steps=commit_log,
        evaluate_if_due=evaluation.if_due)
    return Parts(calls=calls, replicas=replicas, notices=notices, planner=planner,
                 chaos=injector, run_ahead=run_ahead, recovery=recovery,
                 step_boundary=step_boundary, evaluation=evaluation)
