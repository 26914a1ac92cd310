"""The ranks' step times in the step's status (planaria.worker.rank_times): each rank writes
its own slots, the all-reduce's sum holds every rank's; a status that rides in the
gradient's fixed tail carries a page of ranks a step, every rank in turn; the wire form
reads back, and a stream chunk without them (an older worker's) still reads."""

from __future__ import annotations

import math

import torch

from planaria.wire.reports import RankTimes, StepTotals, read_stream_chunk, stream_chunk
from planaria.worker.rank_times import RankSlots
from planaria.worker.reduce import STATUS_TAIL


def _reduced(slots: RankSlots, step: int, width: int, times: dict[int, tuple[float, ...]]
             ) -> list[float]:
    """The status of ``step`` summed over ``width`` ranks, rank r's times ``times[r]``:
    (load, compute, previous reduce-wait, previous apply)."""
    total = torch.zeros(slots.length, dtype=torch.float64)
    for rank in range(width):
        status = slots.new_status(torch.device("cpu"))
        load, compute, wait, apply = times[rank]
        slots.write_own(step, rank, load, compute)
        if step:
            slots.write_previous(step, rank, wait, apply)
        total += status
    return total.tolist()


def test_every_rank_s_times_in_every_step_when_they_fit():
    slots = RankSlots(offset=6, width=3, room=STATUS_TAIL)
    assert slots.per_step == 3 and slots.length == 6 + 12 <= STATUS_TAIL
    times = {r: (0.1 * (r + 1), 0.01 * (r + 1), 0.2 + r, 0.3 + r) for r in range(3)}
    first = slots.read(_reduced(slots, 0, 3, times), 0)
    assert first is not None
    assert all(math.isclose(a, b) for a, b in zip(first.load, (0.1, 0.2, 0.3), strict=True))
    assert all(math.isnan(v) for v in first.reduce_wait + first.apply)  # not known yet
    done = slots.complete(first, _reduced(slots, 1, 3, times))
    assert done.reduce_wait == (0.2, 1.2, 2.2) and done.apply == (0.3, 1.3, 2.3)
    assert done.load == first.load and done.first == 0


def test_a_wide_job_s_status_in_the_tail_carries_a_page_of_ranks_a_step():
    width = 20
    slots = RankSlots(offset=4, width=width, room=STATUS_TAIL)
    assert slots.length <= STATUS_TAIL and 0 < slots.per_step < width
    seen: dict[int, float] = {}
    times = {r: (float(r), 0.0, 100.0 + r, 0.0) for r in range(width)}
    previous: RankTimes | None = None
    for step in range(slots.pages + 1):
        values = _reduced(slots, step, width, times)
        if previous is not None:  # the previous page's reduce-wait, each rank its own
            done = slots.complete(previous, values)
            assert done.reduce_wait == tuple(100.0 + done.first + i
                                             for i in range(len(done.load)))
        page = slots.read(values, step)
        assert page is not None
        for i, load in enumerate(page.load):
            seen[page.first + i] = load
        previous = page
    assert seen == {r: float(r) for r in range(width)}  # every rank, every `pages` steps


def test_a_status_reduced_on_its_own_carries_every_rank():
    assert RankSlots(offset=4, width=64, room=None).per_step == 64
    assert RankSlots(offset=STATUS_TAIL + 1, width=64, room=STATUS_TAIL).per_step == 64
    none = RankSlots(offset=STATUS_TAIL - 2, width=3, room=STATUS_TAIL)  # no room left
    assert none.per_step == 0 and none.length == STATUS_TAIL - 2
    assert none.read([0.0] * none.length, 5) is None
    status = none.new_status(torch.device("cpu"))
    none.write_own(5, 1, 1.0, 1.0)  # nowhere to go: nothing written
    assert not status.any()


def test_rank_times_cross_the_store_and_old_chunks_still_read():
    ranks = RankTimes(first=7, load=(0.5, 0.25), compute=(1.0, 2.0),
                      reduce_wait=(math.nan, 0.125), apply=(0.0, math.nan))
    rec = StepTotals(step=3, t0=1.0, t=2.0, grad_norm=0.5, overflow=False, finite=True,
                     data_wait_s=0.0, global_loss_sum=1.0, global_samples=4,
                     global_metric_sums={}, ranks=ranks)
    assert ranks.to_json() == {"load": [0.5, 0.25], "compute": [1.0, 2.0],
                               "reduce_wait": [None, 0.125], "apply": [0.0, None], "first": 7}
    back = read_stream_chunk(stream_chunk([rec]))[0].ranks
    assert back is not None and back.first == 7 and back.load == (0.5, 0.25)
    assert math.isnan(back.reduce_wait[0]) and back.reduce_wait[1] == 0.125
    old = '[{"step": 1, "t0": 1.0, "t": 2.0, "grad_norm": 0.5, "overflow": false, ' \
          '"finite": true, "data_wait_s": 0.0, "global_loss_sum": 1.0, "global_samples": 4, ' \
          '"global_metric_sums": {}, "lr": 0.1}]'
    assert read_stream_chunk(old)[0].ranks is None
