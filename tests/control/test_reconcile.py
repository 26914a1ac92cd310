"""What a failed run leaves committed (planaria.control.reconcile), on plain values."""

from __future__ import annotations

from planaria.control.reconcile import Reconciled, reconcile
from planaria.wire.reports import Served, Settled, StepRecord


def _rec(step: int) -> StepRecord:
    return StepRecord(step=step, t0=1.0, t=2.0, grad_norm=0.5, overflow=False, finite=True,
                      data_wait_s=0.0, global_loss_sum=1.0, global_samples=4,
                      global_metric_sums={}, served=Served(ids=(step,), digests=None),
                      metric_sums={}, compute_s=0.1, reduce_s=0.1)


def _settled(done: int, steps: range) -> Settled:
    return Settled(steps_done=done, steps=tuple(_rec(s) for s in steps))


def test_the_furthest_survivors_steps_are_committed_and_those_behind_lose_the_state() -> None:
    # Run from step 5: w0 applied 5, 6 and 7 (its last reduction completed), w2 only 5, 6.
    answers = {"w2": _settled(7, range(5, 7)), "w0": _settled(8, range(5, 8))}
    out = reconcile(answers, start=5, members=["w0", "w1", "w2"])
    assert out.committed == 8
    assert [r.step for r in out.applied] == [5, 6, 7]
    assert out.behind == ("w2",)  # w1 was lost: no answer, not "behind"


def test_no_survivor_past_the_start_commits_nothing() -> None:
    out = reconcile({"w0": _settled(5, range(0)), "w1": _settled(5, range(0))}, start=5,
                    members=["w0", "w1"])
    assert out == Reconciled(committed=5, applied=(), behind=())


def test_no_survivor_at_all_keeps_the_start() -> None:
    assert reconcile({}, start=3, members=["w0"]) == Reconciled(committed=3, applied=(),
                                                                 behind=())


def test_records_outside_the_run_are_not_committed_again() -> None:
    # A record of a step before the run's start (kept from an earlier run) is not the run's.
    answers = {"w0": _settled(6, range(3, 6))}
    out = reconcile(answers, start=4, members=["w0"])
    assert [r.step for r in out.applied] == [4, 5]


def test_behind_follows_the_generations_rank_order() -> None:
    answers = {"w3": _settled(9, range(0)), "w1": _settled(9, range(0)),
               "w2": _settled(10, range(9, 10))}
    out = reconcile(answers, start=9, members=["w3", "w2", "w1"])
    assert out.behind == ("w3", "w1")
