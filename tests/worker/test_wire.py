"""The typed wire: how a sharded replica's reports merge (no processes)."""

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
    merge_checksums,
)


def _record(step: int, worker: str, ids: tuple[int, ...], digests: tuple[int, ...] | None,
            metrics: dict[str, float]) -> StepRecord:
    return StepRecord(step=step, worker=worker, t0=1.0, t=2.0, grad_norm=0.5, overflow=False,
                      finite=True, loss_sum=3.0, samples=len(ids), metric_sums=metrics,
                      served=Served(ids=ids, digests=digests), data_wait_s=0.0, compute_s=0.1,
                      reduce_s=0.1, preempting=False, leaving=False, global_loss_sum=6.0,
                      global_samples=4, global_metric_sums={"acc": 2.0})


def test_a_replicas_records_hold_every_workers_samples_in_shard_order_and_summed_metrics():
    mine = [_record(3, "w0", (1, 2), (11, 12), {"acc": 1.0}),
            _record(4, "w0", (5,), (15,), {"acc": 0.5})]
    theirs = [[_record(3, "w0.1", (7,), (17,), {"acc": 0.25, "f1": 1.0})],  # no record of 4
              [_record(3, "w0.2", (8,), None, {})]]
    merged = RunReport(steps=tuple(mine), ended="until", steps_done=5, preempting=False).merge(
        [RunReport(steps=tuple(t), ended="until", steps_done=5, preempting=p)
         for t, p in zip(theirs, (False, True), strict=True)])
    first, second = merged.steps
    assert first.served == Served(ids=(1, 2, 7, 8), digests=None)  # one part kept none
    assert first.metric_sums == {"acc": 1.25, "f1": 1.0}
    assert second.served == Served(ids=(5,), digests=(15,))  # only the leader's came back
    assert merged.preempting  # any worker's notice is the replica's
    assert first.loss == 1.5 and math.isnan(replace(first, global_samples=0).loss)


def test_settled_and_joined_reports_merge_the_same_way():
    rec = _record(2, "w0", (1,), (9,), {})
    settled = Settled(steps_done=3, steps=(rec,)).merge(
        [Settled(steps_done=3, steps=(_record(2, "w0.1", (4,), (8,), {}),))])
    assert settled.steps[0].served == Served(ids=(1, 4), digests=(9, 8))
    joined = Joined(steps_done=2, dropped=Attempt(gen=1, step=2, served=Served(ids=(1,),
                                                                                digests=()))
                    ).merge([Joined(steps_done=2, dropped=Attempt(
                        gen=1, step=2, served=Served(ids=(6,), digests=()))),
                             Joined(steps_done=2, dropped=None)])
    assert joined.dropped is not None and joined.dropped.served.ids == (1, 6)
    assert Joined(steps_done=2, dropped=None).merge([]).dropped is None


def test_a_held_replica_is_as_far_as_its_least_advanced_worker():
    held = Hold(steps_done=5, reduced=True).merge([Hold(steps_done=4, reduced=False)])
    assert held == Hold(steps_done=4, reduced=False)


def test_reports_cross_a_process_boundary_and_checksums_are_in_shard_order():
    rec = _record(1, "w0", (1, 2), (3, 4), {"acc": 1.0})
    assert pickle.loads(pickle.dumps(rec)) == rec
    assert rec.streamed()["global_samples"] == 4
    assert merge_checksums(1, [2]) != merge_checksums(2, [1])
