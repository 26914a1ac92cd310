"""A sharded replica's leader merges its workers' answers into one replica's (planaria.replica):
checked without processes; tests/test_sharded.py runs the real thing."""

from __future__ import annotations


def test_a_replicas_answers_merge_in_shard_order():
    """The leader's merge of its workers' answers (no processes): sums of the step's totals,
    served ids and digests in shard order, any preemption notice, one checksum."""
    from planaria.replica import merge_checksums, merge_records, merge_step

    mine = {"loss_sum": 1.0, "n": 4, "metric_sums": {"a": 1.0}, "ids": [0, 1],
            "digests": ["x", "y"], "compute_s": 0.1, "preempting": False, "grad_norm": 2.0}
    other = {"loss_sum": 2.0, "n": 4, "metric_sums": {"a": 3.0}, "ids": [2, 3],
             "digests": ["z", "w"], "compute_s": 0.3, "preempting": True, "grad_norm": 2.0}
    merged = merge_step(mine, [other])
    assert merged["loss_sum"] == 3.0 and merged["n"] == 8 and merged["metric_sums"] == {"a": 4.0}
    assert merged["ids"] == [0, 1, 2, 3] and merged["digests"] == ["x", "y", "z", "w"]
    assert merged["compute_s"] == 0.3 and merged["preempting"] and merged["grad_norm"] == 2.0
    assert merge_step({**mine, "digests": None}, [other])["digests"] is None
    records = merge_records([{"step": 5, "ids": [0]}, {"step": 6, "ids": [1]}],
                            [[{"step": 6, "ids": [7]}]])
    assert [r["ids"] for r in records] == [[0], [1, 7]]
    assert merge_checksums(1, [2]) != merge_checksums(2, [1])
