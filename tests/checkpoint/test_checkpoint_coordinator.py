"""The checkpoint coordinator's decisions without Ray, on a fake job
(tests/checkpoint_host.py): which checkpoint a restore takes, when a save commits or is
abandoned, when failing saves escalate."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from planaria.checkpoint import (
    commit_checkpoint,
    list_checkpoints,
    plan_shards,
    take_share,
    verify_checkpoint,
    write_shard,
)
from planaria.checkpoint.config import CheckpointConfig
from planaria.checkpoint.coordinator import Checkpointer
from planaria.checkpoint.errors import CheckpointMismatch, NoViableCheckpoint
from planaria.checkpoint.failures import SaveFailures
from planaria.checkpoint.layout import MARKER
from planaria.checkpoint.newest import latest_viable, lineage_checkpoints
from planaria.checkpoint.writer import ShardRecord, write_record
from planaria.faults.errors import CheckpointError
from planaria.wire.state_reports import RestoreRead, ShardWritten, Snapshot
from tests.checkpoint_host import FakeHost, FakeLog, FakePlan, FakeRef, as_host

STATE = {"w": torch.arange(32, dtype=torch.float32).reshape(8, 4), "b": torch.ones(4)}


def commit(root: str, step: int, run_id: str | None, **meta: Any) -> str:
    (plan,) = plan_shards({k: (v.shape, v.dtype) for k, v in STATE.items()}, 1)
    rec = write_shard(root, step, 0, 1, take_share(STATE, plan), save_id=f"s{step}", fsync=False)
    return commit_checkpoint(root, step, [rec], {"steps_done": step, **meta}, world_size=1,
                             run_id=run_id)


# ---- the one rule: the newest viable checkpoint of the lineage -------------------------------

def test_the_newest_viable_checkpoint_is_the_lineages(tmp_path: Path) -> None:
    root = str(tmp_path)
    commit(root, 2, "a")
    mine = commit(root, 4, "a")
    commit(root, 6, "b")  # newer, another run's: never taken
    assert latest_viable(root, lineage=["a"]) == (mine, [])
    assert latest_viable(root, lineage=["b", "a"])[0] == str(tmp_path / "step_000000006")
    assert latest_viable(root, lineage=["c"]) == (None, [])


def test_a_newer_checkpoint_whose_marker_is_unreadable_is_skipped_and_said_so(
        tmp_path: Path) -> None:
    root = str(tmp_path)
    mine = commit(root, 2, "a")
    newer = commit(root, 4, "a")
    (Path(newer) / MARKER).write_bytes(b"{torn")
    path, warnings = latest_viable(root, lineage=["a"])
    assert path == mine
    assert len(warnings) == 1 and "step 4" in warnings[0] and "marker" in warnings[0]
    (Path(mine) / MARKER).write_bytes(b"{torn")  # none known to be ours, some unknown
    with pytest.raises(NoViableCheckpoint, match="markers of 2 committed checkpoints"):
        lineage_checkpoints(root, ["a"], attempts=1)


# ---- restoring into the members ----------------------------------------------------------------

def restore_answers(bad_steps: tuple[int, ...] = (), mismatch: str | None = None):  # type: ignore[no-untyped-def]
    def answer(ref: FakeRef) -> RestoreRead | int:
        if ref.method == "ckpt_read":
            path = ref.args[1]
            if any(path.endswith(f"step_{s:09d}") for s in bad_steps):
                return RestoreRead(error="shard-00001-of-00001.safetensors: checksum mismatch")
            return RestoreRead(mismatch=mismatch)
        if ref.method == "ckpt_apply":
            return 7  # the replica's checksum
        raise AssertionError(ref.method)
    return answer


def checkpointer(tmp_path: Path, host: FakeHost, run_id: str = "a",
                 **cfg: Any) -> Checkpointer:
    config = CheckpointConfig(root=str(tmp_path / "root"), fsync=False, **cfg)
    return Checkpointer(as_host(host), config, run_id=run_id)


def test_a_restore_takes_the_newest_of_its_lineage_that_loads(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    plan = FakePlan().describe()
    commit(root, 2, "a", data_plan=plan, skipped_samples=[5])
    commit(root, 4, "a", data_plan=plan)
    commit(root, 6, "b", data_plan=plan)
    host = FakeHost(tmp_path, ("w0", "w1"), answer=restore_answers(bad_steps=(4,)))
    host.steps_done = 9
    ck = checkpointer(tmp_path, host)
    try:
        assert ck.restore() == 2
    finally:
        ck.close()
    assert host.steps_done == 2 and host.skipped_samples == {5}
    assert all(h.has_state for h in host.members)
    assert ck.last_committed == 2 and ck.last_path is not None
    assert ck.last_path.endswith("step_000000002")
    (event,) = host.log.of("restore")
    assert event["lost_steps"] == 7 and event["strategy"] == "read_all"
    assert len(event["skipped"]) == 1 and "step 4" in event["skipped"][0]
    read = [r.args[1] for r in host.gathered if r.method == "ckpt_read"]
    assert not any(p.endswith("step_000000006") for p in read)  # the other run's: never read
    assert [phase for phase, _ in host.hooks] == ["restore", "restore"]


def test_a_restore_where_nothing_loads_leaves_no_member_holding_state(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    commit(root, 2, "a")
    host = FakeHost(tmp_path, ("w0", "w1"), answer=restore_answers(bad_steps=(2,)))
    ck = checkpointer(tmp_path, host)
    try:
        with pytest.raises(NoViableCheckpoint, match="none of the 1 committed checkpoints"):
            ck.restore()
    finally:
        ck.close()
    assert not any(h.has_state for h in host.members)


def test_no_checkpoint_of_the_lineage_is_nothing_to_restore(tmp_path: Path) -> None:
    commit(str(tmp_path / "root"), 2, "b")
    host = FakeHost(tmp_path, ("w0",), answer=restore_answers())
    ck = checkpointer(tmp_path, host)
    try:
        assert ck.restore() is None
    finally:
        ck.close()
    assert host.gathered == [] and all(h.has_state for h in host.members)


def test_a_checkpoint_that_does_not_fit_is_refused_when_strict(tmp_path: Path) -> None:
    commit(str(tmp_path / "root"), 2, "a")
    host = FakeHost(tmp_path, ("w0",), answer=restore_answers(mismatch="w: shape (8, 4)"))
    ck = checkpointer(tmp_path, host)
    try:
        with pytest.raises(CheckpointMismatch, match="does not fit the job"):
            ck.restore()
    finally:
        ck.close()


# ---- saves ---------------------------------------------------------------------------------------

def snapshot_answers(ref: FakeRef) -> Snapshot:
    assert ref.method == "ckpt_start", ref.method
    return Snapshot(busy=False, nbytes=100, meta={"model": "fake"})


def written(ref: FakeRef, root: str) -> ShardWritten:
    """What writer ``ref.worker`` answers once its share of STATE is written."""
    step, index, width, save_id = ref.args[1:5] if ref.method == "ckpt_start" else (0, 0, 0, "")
    plans = plan_shards({k: (v.shape, v.dtype) for k, v in STATE.items()}, width)
    rec = write_shard(root, step, index, width, take_share(STATE, plans[index]),
                      save_id=save_id, fsync=False)
    return ShardWritten(records=[rec.to_dict()], written_t=time.time())


def started(host: FakeHost) -> dict[str, FakeRef]:
    """The last save's ``ckpt_start`` and ``ckpt_wait`` calls, per writer."""
    return {h.name: h.actor.calls[-2] for h in host.members}


def test_the_last_writers_answer_commits_the_save(tmp_path: Path) -> None:
    host = FakeHost(tmp_path, ("w0", "w1"), answer=snapshot_answers)
    host.steps_done = 3
    ck = checkpointer(tmp_path, host, every=1)
    ck.place.lease.acquire()
    try:
        ck.saves.start(reason="test")
        assert host.commits == 1 and ck.inflight_step == 3
        for h in host.members:
            start, wait = h.actor.calls[-2:]
            assert (start.method, wait.method) == ("ckpt_start", "ckpt_wait")
            wait.answer.set_result(written(start, ck.root))
        ck.finish_inflight()
        assert ck.inflight_step is None and ck.last_committed == 3
    finally:
        ck.close()
    (info,) = list_checkpoints(ck.root)
    assert info.committed and info.step == 3 and verify_checkpoint(info.path).ok
    assert [e["step"] for e in host.log.of("checkpoint_saved")] == [3]
    assert not host.log.of("checkpoint_failed")


def test_a_save_whose_writer_left_is_abandoned_and_its_files_removed(tmp_path: Path) -> None:
    host = FakeHost(tmp_path, ("w0", "w1"), answer=snapshot_answers)
    host.steps_done = 3
    ck = checkpointer(tmp_path, host, every=1)
    ck.place.lease.acquire()
    try:
        ck.saves.start(reason="test")
        start, wait = host.members[0].actor.calls[-2:]
        wait.answer.set_result(written(start, ck.root))  # w0's shard is written ...
        host.leave("w1")  # ... w1 leaves before its own is
        ck.saves.progress(block_s=0.0)  # what the next boundary does first
        assert ck.inflight_step is None and ck.last_committed is None
        (failed,) = host.log.of("checkpoint_failed")
        assert failed["step"] == 3 and "writer w1 left before its shard was written" in \
            failed["error"]
    finally:
        ck.close()
    assert list_checkpoints(ck.root) == []
    assert not [p for p in Path(ck.root).iterdir() if ".tmp-" in p.name]  # w0's shard is gone


def test_a_writers_failure_fails_the_save_and_the_job_goes_on(tmp_path: Path) -> None:
    host = FakeHost(tmp_path, ("w0",), answer=snapshot_answers)
    ck = checkpointer(tmp_path, host, every=1)
    ck.place.lease.acquire()
    try:
        ck.saves.start(reason="test")
        host.members[0].actor.calls[-1].answer.set_exception(OSError(28, "No space left"))
        host.leave("w0")  # (a live writer would be polled until it stops writing: Ray's)
        ck.saves.progress(block_s=0.0)
        (failed,) = host.log.of("checkpoint_failed")
        assert "writer w0 failed: OSError" in failed["error"]
        assert ck.saves.failures.in_a_row == 1 and not host.log.of("checkpoints_failing")
    finally:
        ck.close()


@pytest.mark.parametrize("its_record_written", [True, False])
def test_a_writer_that_died_after_its_shard_was_written_leaves_a_save_that_commits(
        tmp_path: Path, its_record_written: bool) -> None:
    """Written is durable: a writer that dies once its shard and the shard's record are
    written (before its answer came) does not cost the save; one that dies before its
    record is written does (the save is abandoned, its files removed)."""
    host = FakeHost(tmp_path, ("w0", "w1"), answer=snapshot_answers)
    host.steps_done = 3
    ck = checkpointer(tmp_path, host, every=1)
    ck.place.lease.acquire()
    try:
        ck.saves.start(reason="test")
        waits = {h.name: h.actor.calls[-1] for h in host.members}
        answers = {name: written(start, ck.root) for name, start in started(host).items()}
        for name, answer in answers.items():
            if name == "w0" or its_record_written:  # each writer keeps its record beside it
                write_record(ck.root, ShardRecord.from_dict(answer.records[0]),
                             written_t=answer.written_t, fsync=False)
        host.leave("w1")  # w1 dies before it answers ...
        waits["w1"].answer.set_exception(ray.exceptions.ActorDiedError())
        ck.saves.progress(block_s=0.0)  # ... and the save waits for w0's answer
        assert ck.inflight_step == 3 and not host.log.of("checkpoint_failed")
        waits["w0"].answer.set_result(answers["w0"])
        ck.finish_inflight()
        assert ck.inflight_step is None and ck.saves.lost_writers == {"w1"}
    finally:
        ck.close()
    infos = list_checkpoints(ck.root)
    if its_record_written:
        (info,) = infos
        assert info.committed and info.step == 3 and verify_checkpoint(info.path).ok
        assert ck.last_committed == 3 and not host.log.of("checkpoint_failed")
    else:
        assert infos == [] and ck.last_committed is None
        (failed,) = host.log.of("checkpoint_failed")
        assert failed["step"] == 3 and "writer w1 failed: ActorDiedError" in failed["error"]
        assert not [p for p in Path(ck.root).iterdir() if ".tmp-" in p.name]


# ---- escalation ---------------------------------------------------------------------------

def test_saves_failing_in_a_row_escalate_and_stop_the_job_when_asked() -> None:
    log = FakeLog()
    failures = SaveFailures(CheckpointConfig(max_failed_saves=2, on_failing="stop"), "/r", log)
    failures.failed(2, "interval", "disk full", steps_done=2, newest=None)
    failures.raise_if_failing()  # one failure: the job goes on
    failures.committed()
    failures.failed(4, "interval", "disk full", steps_done=4, newest=(2, "/r/step_2"))
    failures.failed(6, "interval", "disk full", steps_done=6, newest=(2, "/r/step_2"))
    (loud,) = log.of("checkpoints_failing")
    assert loud == {"event": "checkpoints_failing", "failed": 2, "newest_step": 2, "step": 6,
                    "error": "disk full", "action": "stop"}
    assert [e["step"] for e in log.of("checkpoint_failed")] == [2, 4, 6]
    with pytest.raises(CheckpointError, match=r"2 checkpoints in a row were not committed under "
                                              r"/r .*step 2 \(/r/step_2\).*on_failing='stop'"):
        failures.raise_if_failing()
    failures.raise_if_failing()  # raised once


def test_failing_saves_only_warn_by_default() -> None:
    log = FakeLog()
    failures = SaveFailures(CheckpointConfig(max_failed_saves=1), "/r", log)
    failures.failed(2, "interval", "disk full", steps_done=2, newest=None)
    assert log.of("checkpoints_failing")[0]["action"] == "warn"
    failures.raise_if_failing()
