"""bench/sim_validation.py's estimator and prediction on records made up here (fast); the
bench itself runs real jobs (docs/simulator.md, "Out of sample")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for bench

from bench.sim_predict import (
    Case,
    harness_victims,
    measured_goodput,
    predict,
)

CAL = {"step_s": 0.1, "step_overhead_s": 0.0, "step_s_by_width": {3: 0.1, 2: 0.15, 1: 0.3},
       "detect_s": 0.2, "rebuild_s": 0.1, "replacement_s": 5.0, "join_stall_s": 0.2,
       "ckpt_stall_s": 0.01, "ckpt_write_s": 0.1, "restore_s": 0.1}
PLANARIA = Case(name="p", system="planaria", kill_every_s=10, ckpt_every=20)


def _commits(periods: list[tuple[float, int]]) -> list[dict]:
    out, t = [], 0.0
    for i, (gap, width) in enumerate(periods):
        t += gap
        out.append({"step": i, "wall": t, "width": width, "started": t - gap})
    return out


def test_measured_goodput_is_useful_steps_at_the_fault_free_period():
    commits = _commits([(0.1, 3)] * 50 + [(1.0, 2)] + [(0.2, 2)] * 10 + [(0.1, 3)] * 40)
    rec = {"t0": 0.0, "t1": commits[-1]["wall"], "replicas": 3, "commits": commits,
           "kills": [{"t_kill": 5.05}]}
    got = measured_goodput(rec)
    assert got["useful_steps"] == 101
    assert got["period_s"] == pytest.approx(0.1)
    assert got["goodput"] == pytest.approx(101 * 0.1 / commits[-1]["wall"])


def test_prediction_is_one_without_kills_and_less_with_them():
    assert predict(CAL, PLANARIA, [], 60.0, 3) == pytest.approx(1.0)
    one = predict(CAL, PLANARIA, [20.0], 60.0, 3)
    two = predict(CAL, PLANARIA, [20.0, 40.0], 60.0, 3)
    assert 1.0 > one > two > 0.8
    slower = predict(CAL, Case(name="s", system="planaria", kill_every_s=10, ckpt_every=20,
                               sleep_s=0.05), [20.0], 60.0, 3)
    assert slower != one  # the sleep changes the step length, and what a kill costs


def test_harness_victims_kill_replicas_in_service():
    assert harness_victims([1.0, 2.0, 3.0], 3, out_s=10.0) == (0, 1, 2)
    assert harness_victims([1.0, 12.0], 3, out_s=10.0) == (0, 0)  # 0 is back by 11
    # A fourth kill while all three are out takes the one out longest (a no-op there).
    assert harness_victims([1.0, 2.0, 3.0, 4.0], 3, out_s=10.0)[-1] == 0
