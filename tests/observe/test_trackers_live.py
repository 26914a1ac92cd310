"""Trackers fed live by a real run: two replicas, a worker killed, CSV and TensorBoard read
back against what fit returned."""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path

import pytest

import planaria
from planaria.examples.mlp import spec

STEPS = 12


@pytest.mark.multiprocess
@pytest.mark.usefixtures("ray_cluster")
def test_csv_and_tensorboard_follow_a_run_with_a_kill(tmp_path: Path) -> None:
    has_tensorboard = importlib.util.find_spec("tensorboard") is not None
    loggers = ["csv", "tensorboard"] if has_tensorboard else ["csv"]
    result = planaria.fit(spec, steps=STEPS, replicas=2, run_dir=tmp_path, loggers=loggers,
                          chaos="kill:w1@step5")
    expected = [(step, loss) for step, loss in result.losses]
    assert result.final_step == STEPS and len(expected) >= STEPS

    folder = tmp_path / "trackers"
    with (folder / "csv" / "steps.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["step"]), float(r["value"])) for r in rows
            if r["name"] == "train/loss"] == expected
    lrs = [float(r["value"]) for r in rows if r["name"] == "train/lr"]
    norms = [float(r["value"]) for r in rows if r["name"] == "train/grad_norm"]
    assert len(lrs) == len(norms) == len(expected)
    assert all(lr > 0 for lr in lrs) and all(math.isfinite(n) and n > 0 for n in norms)
    with (folder / "csv" / "events.csv").open(newline="") as f:
        events = [r["event"] for r in csv.DictReader(f)]
    assert "fault" in events and "recovered" in events

    if has_tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0})
        acc.Reload()
        losses = acc.Scalars("train/loss")
        assert [e.step for e in losses] == [step for step, _ in expected]
        assert [e.value for e in losses] == pytest.approx([v for _, v in expected], rel=1e-6)
        assert [e.value for e in acc.Scalars("events/faults_total")][-1] >= 1
        assert acc.Scalars("events/recoveries_total")
