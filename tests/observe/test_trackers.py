"""Experiment trackers without any tool: the event -> record mapping, the feed that never
lets a tracker stop training, and the CSV tracker read back."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import pytest

from planaria.observe.trackers import (
    Annotation,
    StepScalars,
    TrackerFeed,
    build_trackers,
    parse_names,
    tracker_entry,
)
from planaria.observe.trackers.csv_tracker import CsvTracker
from tests.observe.tracker_stream import STEP_LOSSES, STREAM


def test_a_committed_step_maps_to_its_scalars() -> None:
    entry = tracker_entry(STREAM[1])
    assert entry == StepScalars(step=0, t=101.0, values={
        "train/loss": 2.0, "train/lr": 0.1, "train/samples_per_s": 16.0,
        "train/grad_norm": 1.0, "train/step_s": 0.5, "train/replicas": 2.0, "train/acc": 0.0})
    nan_step = tracker_entry(STREAM[9])
    assert isinstance(nan_step, StepScalars) and "train/loss" not in nan_step.values


def test_an_evaluation_maps_to_eval_scalars_at_its_step() -> None:
    assert tracker_entry(STREAM[10]) == StepScalars(
        step=4, t=105.5, values={"eval/loss": 0.9, "eval/samples": 16.0})


def test_recovery_and_checkpoint_events_map_to_annotations() -> None:
    fault = tracker_entry(STREAM[3])
    assert isinstance(fault, Annotation)
    assert (fault.kind, fault.counter, fault.step) == ("fault", "faults_total", 2)
    assert "worker_lost" in fault.text and "w1" in fault.text
    recovered = tracker_entry(STREAM[6])
    assert isinstance(recovered, Annotation)
    assert recovered.scalars == {"recovery/recover_s": 0.6, "recovery/lost_steps": 1.0}
    saved = tracker_entry(STREAM[7])
    assert isinstance(saved, Annotation) and saved.counter == "checkpoints_saved_total"
    assert saved.scalars == {"checkpoint/stall_s": 0.01, "checkpoint/save_s": 0.2}
    assert tracker_entry(STREAM[0]) is None and tracker_entry(STREAM[-1]) is None


class _Recorder:
    def __init__(self, name: str = "recorder") -> None:
        self.name = name
        self.scalars: list[StepScalars] = []
        self.notes: list[Annotation] = []
        self.closed = 0

    def log_scalars(self, entry: StepScalars) -> None:
        self.scalars.append(entry)

    def log_annotation(self, note: Annotation) -> None:
        self.notes.append(note)

    def close(self) -> None:
        self.closed += 1


class _Broken(_Recorder):
    def log_scalars(self, entry: StepScalars) -> None:
        raise RuntimeError("the server went away")


def test_the_feed_counts_events_and_fills_a_missing_step() -> None:
    rec = _Recorder()
    feed = TrackerFeed([rec])
    for record in STREAM:
        feed(record)
    feed.close()
    feed.close()  # idempotent
    assert rec.closed == 1
    losses = [(e.step, e.values["train/loss"]) for e in rec.scalars if "train/loss" in e.values]
    assert losses == STEP_LOSSES
    detected = next(n for n in rec.notes if n.kind == "detected")
    assert detected.step == 1  # it names no step: the newest committed one
    assert [(n.kind, n.total) for n in rec.notes] == [
        ("fault", 1), ("detected", 1), ("recovered", 1), ("checkpoint_saved", 1)]


def test_a_tracker_that_raises_is_logged_once_and_disabled(
        caplog: pytest.LogCaptureFixture) -> None:
    broken, fine = _Broken("broken"), _Recorder()
    feed = TrackerFeed([broken, fine])
    with caplog.at_level(logging.ERROR, logger="planaria.trackers"):
        for record in STREAM:
            feed(record)
    feed.close()
    assert list(feed.disabled) == ["broken"] and "server went away" in feed.disabled["broken"]
    assert sum("broken" in r.getMessage() for r in caplog.records) == 1
    assert broken.notes == [] and broken.closed == 1  # nothing after the error; still closed
    assert len(fine.scalars) == 6 and len(fine.notes) == 4


def _rows(path: Path) -> list[dict[str, Any]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_csv_tracker_writes_steps_and_events(tmp_path: Path) -> None:
    feed = TrackerFeed([CsvTracker(tmp_path)])
    for record in STREAM:
        feed(record)
    feed.close()
    steps = _rows(tmp_path / "steps.csv")
    assert [(int(r["step"]), float(r["value"])) for r in steps
            if r["name"] == "train/loss"] == STEP_LOSSES
    assert {r["name"] for r in steps} >= {"train/lr", "train/grad_norm", "train/samples_per_s",
                                          "train/acc", "eval/loss"}
    events = _rows(tmp_path / "events.csv")
    assert [r["event"] for r in events] == ["fault", "detected", "recovered", "checkpoint_saved"]
    assert "worker_lost" in events[0]["text"]


def test_trackers_by_name(tmp_path: Path) -> None:
    assert parse_names(" csv, TensorBoard ") == ["csv", "tensorboard"]
    with pytest.raises(ValueError, match="unknown tracker 'neptune'"):
        parse_names("csv,neptune")
    mine = _Recorder()
    built = build_trackers(["csv", mine], tmp_path)
    assert isinstance(built[0], CsvTracker) and built[1] is mine
    assert built[0].dir == tmp_path / "trackers" / "csv"
    built[0].close()


def test_fit_closes_its_trackers_when_it_raises(tmp_path: Path) -> None:
    from planaria import ConfigError, fit
    from planaria.examples.mlp import spec

    mine = _Recorder()
    with pytest.raises(ConfigError):
        fit(spec, steps=1, replicas=0, run_dir=tmp_path, loggers=[mine])
    assert mine.closed == 1


@pytest.mark.parametrize(("name", "module"), [("tensorboard", "torch.utils.tensorboard"),
                                              ("wandb", "wandb"), ("mlflow", "mlflow.tracking")])
def test_a_missing_library_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           name: str, module: str) -> None:
    import sys

    from planaria.observe.trackers import TrackerOptions, build_tracker

    monkeypatch.setitem(sys.modules, module, None)  # an import of it raises ImportError
    with pytest.raises(ImportError, match=rf'pip install "planaria\[{name}\]"'):
        build_tracker(name, tmp_path, TrackerOptions())


def test_a_closed_feed_ignores_later_records() -> None:
    rec = _Recorder()
    feed = TrackerFeed([rec])
    feed.close()
    feed(STREAM[1])
    assert rec.scalars == [] and rec.closed == 1
