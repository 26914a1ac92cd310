"""Where a run of steps ends (planaria.control.boundary), decided without Ray: saves due,
replica checks, hooks and chaos planned by step, open faults, and what ends a run early
(Ray lost, a join, a drain, chaos by time, a save due by the clock)."""

from __future__ import annotations

from typing import Any

from control_fakes import FakeRoster, FakeSchedule, handle
from planaria.control.boundary import BoundaryPlanner
from planaria.control.hooks import FaultHooks
from planaria.faults.chaos import ChaosPlan


class HookAt:
    """A hook that names the boundaries it needs (as a campaign's injector does)."""

    def __init__(self, *steps: int) -> None:
        self.steps = steps
        self.calls: list[tuple[Any, str, dict[str, Any]]] = []

    def __call__(self, job: Any, phase: str, **info: Any) -> None:
        self.calls.append((job, phase, info))

    def next_step(self, after: int) -> int | None:
        return min((s for s in self.steps if s > after), default=None)


def planner(*, width: int = 3, replicas: int = 3, hooks: FaultHooks | None = None,
            checkpoints: FakeSchedule | None = None, chaos: ChaosPlan | None = None,
            verify_every: int | None = None, ready: bool = False,
            draining: dict[str, int] | None = None, ray_lost: bool = False,
            elapsed_s: float = 0.0, nodes: tuple[str, ...] = ()) -> BoundaryPlanner:
    members = [handle(f"w{i}", node=nodes[i] if i < len(nodes) else None)
               for i in range(width)]
    return BoundaryPlanner(
        roster=FakeRoster(members), hooks=hooks or FaultHooks(None),
        checkpoints=checkpoints,  # type: ignore[arg-type]
        chaos=chaos, replicas=replicas, verify_every=verify_every,
        replacements_ready=lambda: ready,
        draining_nodes=None if draining is None else (lambda: draining),
        ray_lost=lambda: ray_lost, elapsed_s=lambda: elapsed_s)


def test_with_nothing_planned_a_run_goes_to_the_end():
    assert planner().next_boundary(0, 100, open_work=False, metrics_known=True) == 100
    assert planner().next_boundary(40, 100, open_work=False, metrics_known=True) == 100


def test_open_faults_joins_and_the_first_step_run_one_step_at_a_time():
    p = planner()
    assert p.next_boundary(7, 100, open_work=True, metrics_known=True) == 8
    assert p.next_boundary(0, 100, open_work=False, metrics_known=False) == 1


def test_a_run_ends_where_a_save_is_due_but_not_at_a_save_behind_it():
    p = planner(checkpoints=FakeSchedule(due_step=25))
    assert p.next_boundary(10, 100, open_work=False, metrics_known=True) == 25
    assert p.next_boundary(25, 100, open_work=False, metrics_known=True) == 100


def test_a_run_ends_at_the_next_replica_check_only_with_more_than_one_replica():
    assert planner(verify_every=8).next_boundary(
        3, 100, open_work=False, metrics_known=True) == 8
    assert planner(verify_every=8).next_boundary(
        8, 100, open_work=False, metrics_known=True) == 16
    assert planner(width=1, verify_every=8).next_boundary(
        3, 100, open_work=False, metrics_known=True) == 100


def test_a_run_ends_at_the_chaos_plans_next_step_and_at_the_hooks_boundaries():
    chaos = ChaosPlan.parse("kill:w1@step30,hang:w0@step50")
    assert planner(chaos=chaos).next_boundary(
        10, 100, open_work=False, metrics_known=True) == 30
    hooks = FaultHooks(None)
    hooks.hooks.append(HookAt(12, 60))
    p = planner(hooks=hooks, chaos=chaos)
    assert p.next_boundary(0, 100, open_work=False, metrics_known=True) == 12
    assert p.next_boundary(12, 100, open_work=False, metrics_known=True) == 30
    hooks.hooks.append(lambda *a, **k: None)  # a hook that names none needs every boundary
    assert p.next_boundary(12, 100, open_work=False, metrics_known=True) == 13


def test_the_earliest_boundary_wins_and_a_run_is_at_least_one_step():
    p = planner(checkpoints=FakeSchedule(due_step=20), verify_every=16,
                chaos=ChaosPlan.parse("kill:w1@step18"))
    assert p.next_boundary(10, 100, open_work=False, metrics_known=True) == 16
    assert p.next_boundary(10, 12, open_work=False, metrics_known=True) == 12
    assert p.next_boundary(10, 10, open_work=False, metrics_known=True) == 11


def test_nothing_unplanned_lets_a_run_go_on():
    assert planner(checkpoints=FakeSchedule()).boundary_wanted() is None


def test_what_ends_a_run_early_and_in_which_order():
    assert planner(ray_lost=True, ready=True, width=2).boundary_wanted() == "ray_lost"
    assert planner(width=2, ready=True).boundary_wanted() == "join"
    assert planner(width=3, ready=True).boundary_wanted() is None  # full width: no join
    assert planner(nodes=("n1", "n2", "n3"), draining={"n2": 0}).boundary_wanted() == "drain"
    assert planner(nodes=("n1", "n2", "n3"), draining={"n9": 0}).boundary_wanted() is None
    assert planner(chaos=ChaosPlan.parse("kill:w1@5s"), elapsed_s=6.0).boundary_wanted() == \
        "chaos"
    assert planner(chaos=ChaosPlan.parse("kill:w1@5s"), elapsed_s=1.0).boundary_wanted() is None
    assert planner(checkpoints=FakeSchedule(due_by_time=True)).boundary_wanted() == "checkpoint"


def test_hooks_are_called_with_the_job_the_phase_and_its_details():
    job = object()
    hooks = FaultHooks(job)
    hook = HookAt()
    hooks.hooks.append(hook)
    hooks.call("join", src="w0", joiners=["w3"])
    assert hook.calls == [(job, "join", {"src": "w0", "joiners": ["w3"]})]
    assert hooks.next_step(5) is None
