"""A failed step's finished micro-batches kept apart from a broken all-reduce
(planaria.worker.kept_work)."""

from __future__ import annotations

import pytest
import torch

from planaria.faults.errors import PlanariaError
from planaria.wire.reports import CarriedStep, HeldWork, Served
from planaria.worker.kept_work import GradientCopy, GradientKeptInPlace, KeptWork


def test_the_copy_holds_saved_regions_as_saved_and_the_others_as_they_are() -> None:
    flat = torch.arange(6.0)
    copy = GradientCopy([flat], [(0, 3, 6), (0, 0, 3)])  # two buckets, the last first
    copy.arm()
    copy.save(0)  # the first bucket's all-reduce starts...
    flat[3:] = 99.0  # ... and a broken collective leaves partial sums in it
    copy.hold()  # the second never started: its values are this rank's own
    flat.zero_()  # the pending gradient dropped
    copy.restore()
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_live_hold_keeps_the_buffers_until_resumed_or_zeroes_them_at_the_next_attempt(
) -> None:
    """Out of place (the ring never writes the buffers): a failed step's own sum stays where
    it is, nothing copied; the reducer's drop leaves it; a resume finds it; an attempt
    started without one begins from zero."""
    flat = torch.arange(4.0)
    copy = GradientKeptInPlace([flat])
    copy.arm()
    copy.save_all()  # the ring starts: nothing copied
    flat_before = flat.data_ptr()
    copy.hold()
    assert copy.holding and flat.data_ptr() == flat_before
    copy.restore()
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0] and not copy.holding
    copy.arm()  # the resumed attempt: its held sum stays, new micro-batches add to it
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0]
    copy.hold()
    copy.arm()  # a fresh attempt, the held sum not resumed
    assert flat.tolist() == [0.0] * 4 and not copy.holding


def test_the_flat_reducer_does_not_drop_a_live_held_sum() -> None:
    from planaria.worker.reduce import FlatGradients, FlatReducer

    model = torch.nn.Linear(2, 1)
    reducer = FlatReducer(FlatGradients(list(model.parameters()), torch.device("cpu")), 8,
                          out_of_place=True)
    model(torch.ones(1, 2)).sum().backward()
    copy = reducer.gradient_copy()
    assert isinstance(copy, GradientKeptInPlace)
    copy.hold()
    reducer.zero()  # the failed step's drop
    assert model.weight.grad is not None and model.weight.grad.tolist() == [[1.0, 1.0]]
    copy.arm()
    reducer.zero()
    assert not model.weight.grad.any()


def test_the_copy_is_allocated_once() -> None:
    flat = torch.ones(4)
    copy = GradientCopy([flat])
    copy.save_all()
    first = [c.data_ptr() for _, c in copy.pairs]
    copy.arm()
    copy.save_all()
    assert [c.data_ptr() for _, c in copy.pairs] == first


def test_settle_reports_the_finished_micro_batches_with_their_sums_and_samples() -> None:
    flat = torch.zeros(3)
    copy = GradientCopy([flat])
    kept = KeptWork()
    kept.start(7, 4, None, None, copy, count=2)
    kept.served = Served(ids=(10, 11, 12, 13), digests=None)
    kept.counts = [(2, None), (2, None)]
    flat += 1.0
    kept.reached(1, 0.5, {"acc": 2.0})  # stopped after micro-batch 4, before 5
    held = kept.settle(7, 7, copy, keepable=True)
    assert held == HeldWork(step=7, micro_batches=(4,), unstarted=(5,))
    assert kept.held is not None and kept.held.served.ids == (10, 11)
    assert (kept.held.samples, kept.held.loss_sum) == (2, 0.5)
    flat.zero_()
    prior = kept.resume(CarriedStep(step=7, kept=(4,), new=(6, 7)), 7, copy)
    assert prior is kept.held and flat.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("case", ["not keepable", "applied", "inside a micro-batch"])
def test_settle_keeps_nothing_where_it_would_not_be_sound(case: str) -> None:
    copy = GradientCopy([torch.zeros(2)])
    kept = KeptWork()
    kept.start(3, 0, None, None, copy)
    kept.counts = [(1, None)]
    if case != "inside a micro-batch":
        kept.reached(1, 0.0, {})
    steps_done = 4 if case == "applied" else 3
    assert kept.settle(steps_done, 3, copy, keepable=case != "not keepable") is None


def test_resuming_what_is_not_held_raises() -> None:
    kept = KeptWork()
    with pytest.raises(PlanariaError, match="resume step 2"):
        kept.resume(CarriedStep(step=2, kept=(0,), new=()), 2, GradientCopy([torch.zeros(1)]))
    assert kept.resume(CarriedStep(step=2, kept=(), new=(0,)), 2, None) is None


def test_settle_tells_what_it_had_not_begun_when_it_finished_none() -> None:
    copy = GradientCopy([torch.zeros(2)])
    kept = KeptWork()
    kept.start(3, 6, None, None, copy, count=2)
    kept.counts = [(1, None), (1, None)]
    kept.reached(0, 0.0, {})  # aborted before its first micro-batch
    assert kept.settle(3, 3, copy, keepable=True) == HeldWork(step=3, micro_batches=(),
                                                               unstarted=(6, 7))
    assert kept.held is None
