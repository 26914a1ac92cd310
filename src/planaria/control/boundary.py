"""The step boundary: where a run of steps must end, and what happens there.

:class:`BoundaryPlanner` decides: the step at which the controller must act next
(a save due, a replica check, an evaluation, a fault a hook or the chaos plan needs, an
open fault or join) and, while a run goes on, whether something it could not plan for ends the
run early (Ray lost, a replacement ready to join, a node drained, chaos by time, a
save due by the clock). :class:`StepBoundary` acts between runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from planaria.control.chaos_injection import ChaosInjector
    from planaria.control.hooks import FaultHooks
    from planaria.control.notices import Notices
    from planaria.control.pool import WorkerHandle
    from planaria.control.protocols import Checkpoints, RayCheck, Roster, StepCount
    from planaria.faults.chaos import ChaosPlan

__all__ = ["BoundaryPlanner", "BoundaryPolicy", "StepBoundary"]


class BoundaryPlanner:
    """Where a job's runs of steps end (see the module doc).

    ``replicas``: the width asked for; ``verify_every``: steps between replica checks
    (None: none); ``eval_every``: steps between evaluations (None: none);
    ``replacements_ready``: a replacement is ready to join (no query but its readiness);
    ``draining_nodes``: the nodes Ray drains, as last seen (None: not
    watched); ``ray_lost``: Ray's GCS or raylet died; ``elapsed_s``: since the job began.
    """

    def __init__(
        self, *, roster: Roster, hooks: FaultHooks, checkpoints: Checkpoints | None,
        chaos: ChaosPlan | None, replicas: int, verify_every: int | None,
        replacements_ready: Callable[[], bool],
        draining_nodes: Callable[[], dict[str, int]] | None,
        ray_lost: Callable[[], bool], elapsed_s: Callable[[], float],
        eval_every: int | None = None,
    ) -> None:
        self.roster = roster
        self.hooks = hooks
        self.checkpoints = checkpoints
        self.chaos = chaos
        self.replicas = replicas
        self.verify_every = verify_every
        self.eval_every = eval_every
        self.replacements_ready = replacements_ready
        self.draining_nodes = draining_nodes
        self.ray_lost = ray_lost
        self.elapsed_s = elapsed_s

    def next_boundary(self, start: int, until: int, *, open_work: bool,
                      metrics_known: bool) -> int:
        """The step count at which the controller must act next (``> start``, at most
        ``until`` unless that is not): one step while faults or joins are open (their first
        committed step closes them) and before the loss's metrics are known (the job's first
        step names them)."""
        if open_work or not metrics_known:
            return start + 1
        stop = until
        planned = self.hooks.next_step(start)
        if planned is not None:
            stop = min(stop, planned)
        ck = self.checkpoints
        if ck is not None:
            due = ck.next_due_step()
            if due is not None and due > start:
                stop = min(stop, due)
        every = self.verify_every
        if every is not None and self.roster.width > 1:
            stop = min(stop, (start // every + 1) * every)
        every = self.eval_every
        if every is not None:  # the controller evaluates there, before the next run
            stop = min(stop, (start // every + 1) * every)
        if self.chaos is not None:
            planned = self.chaos.next_step(after=start)
            if planned is not None:
                stop = min(stop, planned)
        return max(start + 1, stop)

    def boundary_wanted(self) -> str | None:
        """Why a run of steps should end at the next boundary now, or None: something the
        controller could not plan for. Queries nothing remote but the replacements'
        readiness."""
        if self.ray_lost():
            return "ray_lost"
        if self.roster.width < self.replicas and self.replacements_ready():
            return "join"
        if self.draining_nodes is not None:
            nodes = self.draining_nodes()
            if nodes and any(h.ray_node in nodes for h in self.roster.members):
                return "drain"
        if self.chaos is not None and self.chaos.time_due(self.elapsed_s()):
            return "chaos"
        if self.checkpoints is not None and self.checkpoints.due_by_time():
            return "checkpoint"
        return None


class BoundaryPolicy(Protocol):
    """What the recovery policy does at a step boundary: ``admit`` ready replacements into
    the next generation (a survivor sends them the state), ``drain`` preempted members
    (they leave with nothing lost). Either may raise a Failure (the caller recovers)."""

    def admit(self, ready: list[WorkerHandle]) -> None: ...

    def drain(self, names: list[str]) -> None: ...


class StepBoundary:
    """Between runs: Ray's health, the replica check, the hooks, joins, drains, the
    evaluation, saves and chaos by time, in that order. ``check_ray(save=True)`` raises
    RayLost once Ray's own processes died (saving the step in hand first); ``verify_if_due``
    compares the replicas' checksums when a check is due; ``evaluate_if_due`` evaluates
    when an evaluation is due (over the width the joins and drains left); ``poll_ready``
    returns replacements ready now (no wait)."""

    def __init__(
        self, *, check_ray: RayCheck, verify_if_due: Callable[[], None],
        hooks: FaultHooks, poll_ready: Callable[[], list[WorkerHandle]],
        policy: BoundaryPolicy, notices: Notices, checkpoints: Checkpoints | None,
        chaos: ChaosInjector | None, steps: StepCount,
        evaluate_if_due: Callable[[], object] = lambda: None,
    ) -> None:
        self.check_ray = check_ray
        self.evaluate_if_due = evaluate_if_due
        self.verify_if_due = verify_if_due
        self.hooks = hooks
        self.poll_ready = poll_ready
        self.policy = policy
        self.notices = notices
        self.checkpoints = checkpoints
        self.chaos = chaos
        self.steps = steps

    def boundary(self) -> None:
        """Between steps: drain preempted workers, admit ready replacements, evaluate, save,
        inject chaos."""
        self.check_ray(save=True)  # Ray's own processes died: save and end
        self.verify_if_due()  # before a joiner could copy a diverged replica's state
        self.hooks.call("boundary")
        ready = self.poll_ready()
        if ready:  # first, so that a joiner can take the state from a worker about to drain
            self.policy.admit(ready)
        self.notices.notice_draining_nodes()
        draining = self.notices.take_draining()
        if draining:
            self.policy.drain(draining)
        self.evaluate_if_due()  # a Failure here: recovered from, then evaluated again
        if self.checkpoints is not None:
            self.checkpoints.maybe_save()
        if self.chaos is not None:
            self.chaos.by_time(self.steps.steps_done)
