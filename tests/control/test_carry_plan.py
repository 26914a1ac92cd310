"""The rule that resumes a failed step: each survivor keeps what it holds, the rest is
split over the new generation (planaria.control.carry_plan)."""

from __future__ import annotations

import numpy as np

from planaria.control.carry_plan import HeldSteps, plan_carry
from planaria.data.plan import micro_batch_ids
from planaria.wire.reports import CarriedStep, HeldWork, Settled


def held(step: int, *mbs: int) -> HeldWork:
    return HeldWork(step=step, micro_batches=tuple(mbs))


def test_survivors_keep_theirs_and_the_dead_share_is_split_over_the_new_ranks() -> None:
    # 12 micro-batches at 3 ranks; w1 (4..7) died; a joiner w3 came in its place.
    plan = plan_carry(5, {"w0": held(5, 0, 1, 2, 3), "w2": held(5, 8, 9, 10, 11)},
                      ["w0", "w2", "w3"], 12)
    assert plan is not None
    assert (plan.kept, plan.redone, plan.total) == (8, 4, 12)
    assert plan.shares == {
        "w0": CarriedStep(step=5, kept=(0, 1, 2, 3), new=(4, 5)),
        "w2": CarriedStep(step=5, kept=(8, 9, 10, 11), new=(6,)),
        "w3": CarriedStep(step=5, kept=(), new=(7,)),
    }


def test_a_survivor_that_had_not_finished_leaves_the_rest_to_be_split() -> None:
    plan = plan_carry(2, {"w0": held(2, 0), "w2": held(2, 8, 9, 10, 11)}, ["w0", "w2"], 12)
    assert plan is not None and (plan.kept, plan.redone) == (5, 7)
    assert plan.shares["w0"].new == (1, 2, 3, 4) and plan.shares["w2"].new == (5, 6, 7)
    every = [j for s in plan.shares.values() for j in (*s.kept, *s.new)]
    assert sorted(every) == list(range(12))


def test_what_survivors_had_not_begun_is_told_apart_from_the_work_lost() -> None:
    # 6 micro-batches at 3 ranks, w1 (2, 3) died: w0 finished 0 and had not begun 1; w2 had
    # begun neither of its own (4, 5). Computed now: 1..5; lost: only the dead's 2 and 3.
    plan = plan_carry(4, {"w0": HeldWork(step=4, micro_batches=(0,), unstarted=(1,)),
                          "w2": HeldWork(step=4, micro_batches=(), unstarted=(4, 5))},
                      ["w0", "w2"], 6)
    assert plan is not None
    assert (plan.kept, plan.redone, plan.unstarted) == (1, 5, 3)
    assert plan.redone - plan.unstarted == 2  # the dead rank's share: 1/R of the step


def test_nothing_held_or_held_of_another_step_or_by_a_non_member_plans_nothing() -> None:
    assert plan_carry(3, {}, ["w0"], 4) is None
    assert plan_carry(3, {"w0": held(2, 0, 1)}, ["w0"], 4) is None
    assert plan_carry(3, {"w9": held(3, 0, 1)}, ["w0"], 4) is None
    assert plan_carry(3, {"w0": held(3, 0), "w1": held(3, 0)}, ["w0", "w1"], 4) is None


def test_held_steps_plan_only_the_next_run_at_the_held_step() -> None:
    steps = HeldSteps(total=4)
    answers = {
        "w0": Settled(steps_done=3, steps=(), held=held(3, 0, 1)),
        "w2": Settled(steps_done=3, steps=(), held=None),  # kept nothing (a fall-back)
    }
    steps.settled(answers, committed=3)
    assert steps.take(4, ["w0", "w2"]) is None  # a run past it: what was held is stale
    steps.settled(answers, committed=3)
    plan = steps.take(3, ["w0", "w2"])
    assert plan is not None and plan.shares["w2"].new == (3,)
    assert steps.take(3, ["w0", "w2"]) is None  # once


def test_a_survivor_that_applied_the_step_carries_nothing() -> None:
    steps = HeldSteps(total=4)
    answers = {"w0": Settled(steps_done=4, steps=(), held=None),
               "w2": Settled(steps_done=3, steps=(), held=held(3, 2, 3))}
    steps.settled(answers, committed=4)  # w2 is behind: it receives the state of step 4
    assert steps.take(4, ["w0", "w2"]) is None


def test_a_share_that_is_not_contiguous_takes_its_micro_batches_ids_in_order() -> None:
    ids = np.arange(100, 112)
    assert micro_batch_ids(ids, (4, 1), 2).tolist() == [108, 109, 102, 103]
    assert micro_batch_ids(ids, (), 2).tolist() == []
