"""Evaluation decided without Ray (planaria.control.evaluation, planaria.wire.evaluation): the
split of the eval set over the replicas, the combination of their figures, when an evaluation
is due, and that one is recorded once per step."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from control_fakes import FakeRoster, handle
from planaria.control.boundary import BoundaryPlanner
from planaria.control.evaluation import Evaluation, check_eval_config, combine, gather_batches
from planaria.control.hooks import FaultHooks
from planaria.examples import mlp
from planaria.faults.errors import ConfigError, ElasticRuntimeError, WorkerLost
from planaria.wire.evaluation import EvalBatch, EvalReport, eval_batches, num_eval_batches

VALUES = [0.1 * i + 1 / 3 for i in range(23)]  # one "sample" each: an eval set of 23


def test_the_eval_set_is_cut_by_index_and_dealt_round_robin():
    assert num_eval_batches(23, 5) == 5 and num_eval_batches(20, 5) == 4
    assert eval_batches(23, 5, 0, 1) == [(0, range(0, 5)), (1, range(5, 10)),
                                        (2, range(10, 15)), (3, range(15, 20)),
                                        (4, range(20, 23))]  # the last batch shorter
    assert eval_batches(23, 5, 1, 3) == [(1, range(5, 10)), (4, range(20, 23))]
    assert eval_batches(3, 5, 2, 3) == []  # more replicas than batches: some run none
    for width in (1, 2, 3, 7):  # every batch once, whatever the width
        dealt = [j for p in range(width) for j, _ in eval_batches(23, 5, p, width)]
        assert sorted(dealt) == list(range(5))
    with pytest.raises(ValueError):
        eval_batches(23, 5, 3, 3)


def report(place: int, width: int, *, size: int = 5, n: int = len(VALUES),
           steps_done: int = 0) -> EvalReport:
    """What a replica answers, its figures each batch's mean of VALUES (and of their squares)."""
    batches = []
    for j, ids in eval_batches(n, size, place, width):
        xs = [VALUES[i] for i in ids]
        batches.append(EvalBatch(index=j, samples=len(xs), metrics={
            "x": sum(xs) / len(xs), "x2": sum(x * x for x in xs) / len(xs)}))
    return EvalReport(batches=tuple(batches), num_samples=n, steps_done=steps_done)


def test_the_figures_are_the_sample_weighted_mean_and_the_same_at_any_width():
    one = combine(gather_batches([report(0, 1)], 5))
    assert one["x"] == pytest.approx(sum(VALUES) / len(VALUES), rel=1e-12)
    assert one["x2"] == pytest.approx(sum(x * x for x in VALUES) / len(VALUES), rel=1e-12)
    for width in (2, 3, 7):
        reports = [report(p, width) for p in range(width)]
        assert combine(gather_batches(reversed(reports), 5)) == one  # exactly


def test_a_metric_some_batches_lack_is_their_mean():
    batches = [EvalBatch(index=0, samples=2, metrics={"a": 1.0, "b": 4.0}),
               EvalBatch(index=1, samples=1, metrics={"a": 4.0})]
    assert combine(batches) == {"a": 2.0, "b": 4.0}
    assert combine([]) == {}
    assert math.isnan(combine([EvalBatch(index=0, samples=0, metrics={"a": 1.0})])["a"])


def test_a_missing_or_repeated_batch_or_unequal_eval_sets_are_refused():
    with pytest.raises(ElasticRuntimeError, match="batches"):
        gather_batches([report(0, 2)], 5)  # place 1's batches missing
    with pytest.raises(ElasticRuntimeError, match="batches"):
        gather_batches([report(0, 1), report(0, 2)], 5)
    with pytest.raises(ElasticRuntimeError, match="differ in size"):
        gather_batches([report(0, 2), report(1, 2, n=20)], 5)


class FakeEvalActor:
    """A worker's ``evaluate`` remote method; the "ref" is its report, or an error to raise."""

    def __init__(self, owner: FakeCalls, name: str) -> None:
        self.owner, self.name = owner, name
        self.evaluate = self

    def remote(self, gen: int, step: int, place: int, width: int) -> Any:
        self.owner.asked.append((self.name, step, place, width))
        if self.name in self.owner.dying:
            return WorkerLost(f"{self.name} died", workers=(self.name,))
        return report(place, width, steps_done=step)


class FakeCalls:
    """planaria.control.protocols.Gather over FakeEvalActor's refs."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int, int, int]] = []
        self.dying: set[str] = set()

    def gather(self, refs: dict[str, Any], *, deadline_s: float, step: int | None,
               poll: Any = None) -> dict[str, Any]:
        for value in refs.values():
            if isinstance(value, Exception):
                raise value
        return dict(refs)


class Steps:
    steps_done = 0


class Log:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        self.records.append((event, fields))
        return fields


def evaluation(width: int, *, eval_every: int | None = 2
               ) -> tuple[Evaluation, FakeRoster, FakeCalls, Steps, Log]:
    calls, steps, log = FakeCalls(), Steps(), Log()
    roster = FakeRoster([dataclasses.replace(handle(f"w{i}"), actor=FakeEvalActor(calls, f"w{i}"))
                         for i in range(width)])
    spec = dataclasses.replace(mlp.make_spec(), eval_dataset=lambda: None, eval_batch_size=5)
    committed: list[int] = []
    ev = Evaluation(spec=spec, roster=roster, calls=calls, steps=steps,  # type: ignore[arg-type]
                    commit_all=lambda: committed.append(steps.steps_done),
                    log=log, eval_every=eval_every)  # type: ignore[arg-type]
    return ev, roster, calls, steps, log


def test_an_evaluation_is_due_every_eval_every_steps_once():
    ev, _, calls, steps, log = evaluation(3)
    assert not ev.due()  # no step committed yet
    steps.steps_done = 2
    assert ev.due()
    result = ev.if_due()
    assert result is not None and result.step == 2 and result.samples == len(VALUES)
    assert sorted(place for _, _, place, _ in calls.asked) == [0, 1, 2]
    assert not ev.due() and ev.if_due() is None  # recorded: not again at step 2
    steps.steps_done = 3
    assert not ev.due()
    assert [e for e, _ in log.records] == ["eval"]
    assert log.records[0][1]["metrics"] == result.metrics and log.records[0][1]["width"] == 3
    never, *_ = evaluation(3, eval_every=None)
    assert not never.due()


def test_a_failed_evaluation_records_nothing_and_runs_again_over_the_new_width():
    ev, roster, calls, steps, log = evaluation(3)
    steps.steps_done = 4
    calls.dying.add("w1")
    with pytest.raises(WorkerLost):
        ev.if_due()
    assert ev.results == [] and log.records == [] and ev.due()
    roster.evict(["w1"])  # the recovery: the survivors go on
    calls.asked.clear()
    result = ev.if_due()
    assert result is not None and [r.step for r in ev.results] == [4]
    assert sorted((n, p, w) for n, _, p, w in calls.asked) == [("w0", 0, 2), ("w2", 1, 2)]
    alone, *_ = evaluation(1)
    alone.steps.steps_done = 4  # type: ignore[misc]
    assert alone.evaluate().metrics == result.metrics  # the same figures at width 1


def test_an_evaluation_again_at_a_step_replaces_the_one_recorded():
    ev, _, _, steps, _ = evaluation(3)
    for step in (4, 2, 4):
        steps.steps_done = step
        ev.evaluate()
    assert [r.step for r in ev.results] == [2, 4]


def test_a_run_of_steps_ends_where_an_evaluation_is_due():
    members = [handle(f"w{i}") for i in range(3)]
    planner = BoundaryPlanner(
        roster=FakeRoster(members), hooks=FaultHooks(None), checkpoints=None, chaos=None,
        replicas=3, verify_every=None, replacements_ready=lambda: False, draining_nodes=None,
        ray_lost=lambda: False, elapsed_s=lambda: 0.0, eval_every=4)
    assert planner.next_boundary(0, 10, open_work=False, metrics_known=True) == 4
    assert planner.next_boundary(4, 10, open_work=False, metrics_known=True) == 8
    assert planner.next_boundary(8, 10, open_work=False, metrics_known=True) == 10


def test_eval_every_without_an_eval_set_is_refused_by_name(tmp_path):
    from planaria.config import RunConfig

    config = RunConfig(steps=4, replicas=1, run_dir=tmp_path, eval_every=2)
    with pytest.raises(ConfigError, match="eval_every=2 is not valid"):
        check_eval_config(mlp.make_spec(), config)
    ev, *_ = evaluation(1)
    ev.spec = mlp.make_spec()
    with pytest.raises(ConfigError, match="eval_dataset"):
        ev.evaluate()
