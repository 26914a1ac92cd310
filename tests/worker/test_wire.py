"""The typed wire (planaria.wire.reports): how a sharded replica's reports merge, and the
reports' JSON forms in the store; checked without processes (tests/worker/test_sharded.py
runs the real thing)."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace

from planaria.wire.reports import (
    Attempt,
    Hold,
    Joined,
    RunReport,
    Served,
    Settled,
    StepRecord,
    StepTotals,
    merge_checksums,
    read_served_lines,
    read_stream_chunk,
    served_line,
    stream_chunk,
)


def _record(step: int, ids: tuple[int, ...], digests: tuple[int, ...] | None,
            metrics: dict[str, float]) -> StepRecord:
    return StepRecord(step=step, t0=1.0, t=2.0, grad_norm=0.5, overflow=False, finite=True,
                      data_wait_s=0.0, global_loss_sum=6.0, global_samples=4, lr=0.01,
                      global_metric_sums={"acc": 2.0}, served=Served(ids=ids, digests=digests),
                      metric_sums=metrics, compute_s=0.1, reduce_s=0.1)


def test_a_replicas_records_hold_every_workers_samples_in_shard_order_and_summed_metrics():
    """A step whose records did not come back from a follower keeps the leader's; the
    step's totals and norm are the leader's (every worker has the same)."""
    mine = [_record(3, (1, 2), (11, 12), {"acc": 1.0}),
            _record(4, (5,), (15,), {"acc": 0.5})]
    theirs = [[_record(3, (7,), (17,), {"acc": 0.25, "f1": 1.0})],  # no record of 4
              [_record(3, (8,), (18,), {})]]
    merged = RunReport(steps=tuple(mine), ended="until", steps_done=5, preempting=False).merge(
        [RunReport(steps=tuple(t), ended="until", steps_done=5, preempting=p)
         for t, p in zip(theirs, (False, True), strict=True)])
    first, second = merged.steps
    assert first.served == Served(ids=(1, 2, 7, 8), digests=(11, 12, 17, 18))
    assert first.metric_sums == {"acc": 1.25, "f1": 1.0}
    assert first.grad_norm == 0.5 and first.global_metric_sums == {"acc": 2.0}
    assert second.served == Served(ids=(5,), digests=(15,))  # only the leader's came back
    assert merged.preempting and merged.ended == "until"  # any worker's notice is the replica's
    assert first.loss == 1.5 and math.isnan(replace(first, global_samples=0).loss)
    partial = _record(3, (9,), None, {})  # a part that kept no digests: the replica has none
    assert first.with_parts([partial]).served.digests is None


def test_settled_and_joined_reports_merge_the_same_way():
    rec = _record(2, (1,), (9,), {})
    settled = Settled(steps_done=3, steps=(rec,)).merge(
        [Settled(steps_done=3, steps=(_record(2, (4,), (8,), {}),))])
    assert settled.steps[0].served == Served(ids=(1, 4), digests=(9, 8))
    joined = Joined(steps_done=2, dropped=Attempt(gen=1, step=2, served=Served(ids=(1,),
                                                                                digests=None))
                    ).merge([Joined(steps_done=2, dropped=Attempt(
                        gen=1, step=2, served=Served(ids=(6,), digests=None))),
                             Joined(steps_done=2, dropped=None)])
    assert joined.dropped is not None and joined.dropped.served.ids == (1, 6)
    assert Joined(steps_done=2, dropped=None).merge([]).dropped is None


def test_a_held_replica_is_as_far_as_its_least_advanced_worker():
    assert Hold(steps_done=5).merge([Hold(steps_done=4), Hold(steps_done=6)]) == Hold(
        steps_done=4)


def test_reports_cross_a_process_boundary_and_checksums_are_in_shard_order():
    rec = _record(1, (1, 2), (3, 4), {"acc": 1.0})
    report = RunReport(steps=(rec,), ended="stop", steps_done=2, preempting=False)
    assert pickle.loads(pickle.dumps(report)) == report
    assert merge_checksums(1, [2]) != merge_checksums(2, [1])


def test_the_store_carries_a_steps_totals_and_a_ranks_served_samples_as_json():
    rec = _record(1, (1, 2), (3, 4), {"acc": 1.0})
    [totals] = read_stream_chunk(stream_chunk([rec]).encode())
    assert type(totals) is StepTotals and totals.step == 1 and totals.loss == rec.loss
    assert totals.global_metric_sums == {"acc": 2.0} and totals.t0 == rec.t0
    assert totals.lr == 0.01  # the learning rate the step applied, for the trackers
    text = served_line(1, "w0", rec.served) + served_line(2, "w1", Served(ids=[5], digests=None))
    assert list(read_served_lines(text)) == [(1, "w0", Served(ids=[1, 2], digests=[3, 4])),
                                             (2, "w1", Served(ids=[5], digests=None))]
