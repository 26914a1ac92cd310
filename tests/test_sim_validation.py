"""The simulator, calibrated from a real run with chaos, predicts that run's goodput."""

from __future__ import annotations

import pytest

from planaria import fit
from planaria.examples import mlp
from planaria.sim import simulate
from planaria.sim.calibrate import calibrate


@pytest.mark.slow
@pytest.mark.multiprocess
def test_calibrated_simulator_predicts_the_runs_goodput(ray_cluster, tmp_path):
    # Long enough (at ~30 ms a step) for both replacements to start and join live.
    fit(mlp.make_spec(), steps=600, replicas=3, run_dir=tmp_path,
        chaos="kill:w1@step30,kill:w0@step60", ledger=False)
    cal = calibrate(tmp_path)
    assert cal.strategy == "resize" and len(cal.params.trace.times) == 2
    predicted = simulate(cal.params, cal.strategy, interval_s=cal.interval_s)
    # The event log counts a step at reduced width as goodput; the simulator splits it.
    pred = predicted.goodput + predicted.badput["reduced_width"]
    measured = cal.measured_goodput
    assert pred == pytest.approx(measured, abs=0.03), (pred, measured, cal.figures)
    # The same after the start (which weighs heavily in a short run on a busy machine).
    start = cal.figures["startup_s"] or 0.0
    pred_run = pred * predicted.wall_s / (predicted.wall_s - start)
    measured_run = measured * cal.summary.wall_s / (cal.summary.wall_s - start)
    assert pred_run == pytest.approx(measured_run, abs=0.03), (pred_run, measured_run)
