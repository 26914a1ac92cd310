"""A writer's answer to a save is handled on Ray's thread: a fault in that handling itself
fails the save at once instead of leaving it unsettled until its deadline."""

from __future__ import annotations

from concurrent.futures import Future

from planaria.checkpoint.saving import Save, SavePipeline
from planaria.wire.state_reports import ShardWritten


def _pipeline() -> SavePipeline:
    # Only the answer bookkeeping runs here: it touches no storage, host or interval.
    pipeline = object.__new__(SavePipeline)
    pipeline.lost_writers = set()
    return pipeline


def _answered(value: object) -> Future[object]:
    fut: Future[object] = Future()
    fut.set_result(value)
    return fut


def test_a_malformed_answer_fails_the_save_and_settles_it() -> None:
    save = Save(step=4, save_id="s", reason="interval", writers={"w0": None, "w1": None}, t0=0.0)
    _pipeline().on_written(save, "w0", _answered(ShardWritten(records=[{"no": "fields"}],
                                                             written_t=1.0)))
    assert save.settled.is_set()
    assert save.failed is not None and "writer w0's answer could not be handled" in save.failed
    assert save.commit is None


def test_a_handled_answer_leaves_the_save_waiting_for_the_other_writer() -> None:
    save = Save(step=4, save_id="s", reason="interval", writers={"w0": None, "w1": None}, t0=0.0)
    _pipeline().on_written(save, "w0", _answered(ShardWritten(records=[], written_t=1.0)))
    assert save.records == {"w0": []} and save.written_t == {"w0": 1.0}
    assert not save.settled.is_set() and save.failed is None
