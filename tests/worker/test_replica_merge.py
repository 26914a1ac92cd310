"""A sharded replica's leader merges its workers' answers into one replica's
(planaria.worker.replica):
checked without processes; tests/worker/test_sharded.py runs the real thing."""

from __future__ import annotations


def test_a_replicas_answers_merge_in_shard_order():
    """The leader's merge of its workers' run records (no processes): served ids and
    digests in shard order, the step's own metric sums added, one checksum; a step whose
    records did not come back from a follower keeps the leader's."""
    from planaria.worker.replica import merge_checksums, merge_records, merge_run

    mine = {"step": 6, "metric_sums": {"a": 1.0}, "ids": [0, 1], "digests": ["x", "y"],
            "grad_norm": 2.0}
    other = {"step": 6, "metric_sums": {"a": 3.0}, "ids": [2, 3], "digests": ["z", "w"],
             "grad_norm": 2.0}
    [merged] = merge_records([mine], [[other]])
    assert merged["metric_sums"] == {"a": 4.0} and merged["grad_norm"] == 2.0
    assert merged["ids"] == [0, 1, 2, 3] and merged["digests"] == ["x", "y", "z", "w"]
    assert merge_records([{**mine, "digests": None}], [[other]])[0]["digests"] is None
    records = merge_records([{"step": 5, "ids": [0]}, {"step": 6, "ids": [1]}],
                            [[{"step": 6, "ids": [7]}]])
    assert [r["ids"] for r in records] == [[0], [1, 7]]
    run = merge_run({"steps": [mine], "preempting": False, "ended": "until"},
                    [{"steps": [other], "preempting": True}])
    assert run["preempting"] and run["steps"][0]["metric_sums"] == {"a": 4.0}
    assert merge_checksums(1, [2]) != merge_checksums(2, [1])
