"""TensorBoard, MLflow and W&B trackers fed a recorded event stream, their output read back
with each tool's own reader (no Ray). Each is skipped where its extra is not installed."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from planaria.observe.trackers import TrackerFeed, TrackerOptions, build_tracker
from tests.observe.tracker_stream import STEP_LOSSES, STREAM


def _feed(tracker: Any) -> None:
    feed = TrackerFeed([tracker])
    for record in STREAM:
        feed(record)
    feed.close()
    assert not feed.disabled


def test_tensorboard_event_files_hold_the_steps_and_the_recovery(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _feed(build_tracker("tensorboard", tmp_path, TrackerOptions()))
    acc = EventAccumulator(str(tmp_path / "trackers" / "tensorboard"),
                           size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    losses = acc.Scalars("train/loss")  # float32
    assert [e.step for e in losses] == [step for step, _ in STEP_LOSSES]
    assert [e.value for e in losses] == pytest.approx([loss for _, loss in STEP_LOSSES])
    assert [e.value for e in acc.Scalars("train/lr")] == pytest.approx([0.1] * 5)
    assert [e.step for e in acc.Scalars("train/grad_norm")] == [0, 1, 1, 2, 3]
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(4, pytest.approx(0.9))]
    assert [(e.step, e.value) for e in acc.Scalars("events/faults_total")] == [(2, 1.0)]
    assert [e.value for e in acc.Scalars("recovery/recover_s")] == pytest.approx([0.6])
    texts = acc.Tensors("events/fault/text_summary")  # add_text's summaries
    assert texts[0].step == 2
    assert b"worker_lost" in texts[0].tensor_proto.string_val[0]


def test_mlflow_file_store_holds_the_steps_and_the_recovery(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    from mlflow.tracking import MlflowClient

    tracker = build_tracker("mlflow", tmp_path, TrackerOptions(run_name="r1", project="exp"))
    _feed(tracker)
    client = MlflowClient(tracker.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    history = client.get_metric_history(tracker.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == sorted(STEP_LOSSES)
    assert [m.value for m in client.get_metric_history(tracker.run_id, "faults_total")] == [1]
    assert [m.value for m in client.get_metric_history(tracker.run_id, "eval/loss")] == [0.9]
    assert "worker_lost" in run.data.tags["planaria.last_fault"]
    text = Path(client.download_artifacts(tracker.run_id, "planaria_events.txt",
                                          str(tmp_path))).read_text()
    assert "fault: " in text and "recovered: " in text


_BLOCK = 32768  # the .wandb file is a LevelDB-style log of protobuf records


def _wandb_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def test_wandb_offline_run_holds_the_steps_and_the_recovery(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _feed(build_tracker("wandb", tmp_path, TrackerOptions(run_name="r1", wandb_mode="offline")))
    # run.finish() only informs wandb's service process, which flushes and closes the .wandb
    # file later (at exit for a user's script): teardown waits for it to shut down.
    wandb.teardown()
    (path,) = (tmp_path / "trackers" / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                            for i in record.history.item})
        elif kind == "summary":
            summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                            for i in record.summary.update})
    assert [(h["step"], h["train/loss"]) for h in history if "train/loss" in h] == STEP_LOSSES
    assert [(h["step"], h["events/faults_total"]) for h in history
            if "events/faults_total" in h] == [(2, 1)]
    assert [h["eval/loss"] for h in history if "eval/loss" in h] == [0.9]
    assert summary["faults_total"] == 1 and "worker_lost" in summary["last_fault"]
    assert summary["events/nrows"] == 4  # the events table
