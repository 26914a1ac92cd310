"""The simulator, calibrated from a real run with chaos, predicts that run's goodput."""

from __future__ import annotations

import pytest

from planaria import RecoveryPolicy, fit
from planaria.checkpoint.config import CheckpointConfig
from planaria.examples import mlp
from planaria.sim import simulate
from planaria.sim.calibrate import calibrate

RUNS = {
    # ~30 ms a step: long enough for both replacements to start and join live.
    "resize": dict(steps=600, chaos="kill:w1@step30,kill:w0@step60"),
    # Back to the save after step 100, then to the one after step 250.
    "restore": dict(steps=400, chaos="kill:w1@step120,kill:w0@step290",
                    policy=RecoveryPolicy(on_worker_lost="restore"),
                    checkpoint=CheckpointConfig(every=50, resume=False, fsync=False)),
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "strategy",
    [pytest.param(s, marks=pytest.mark.extended) for s in RUNS],
)
def test_calibrated_simulator_predicts_the_runs_goodput(ray_cluster, tmp_path, strategy):
    fit(mlp.make_spec(), replicas=3, run_dir=tmp_path, ledger=False, **RUNS[strategy])
    cal = calibrate(tmp_path)
    assert cal.strategy == strategy and len(cal.params.trace.times) == 2
    predicted = simulate(cal.params, cal.strategy, interval_s=cal.interval_s)
    # The event log counts a step at reduced width as goodput; the simulator splits it.
    pred = predicted.goodput + predicted.badput["reduced_width"]
    measured = cal.measured_goodput
    print(f"{strategy}: predicted {pred:.4f}, measured {measured:.4f}; {cal.figures}")
    assert pred == pytest.approx(measured, abs=0.03), (pred, measured, cal.figures)
    # The same after the start (which weighs heavily in a short run on a busy machine).
    start = cal.figures["startup_s"] or 0.0
    pred_run = pred * predicted.wall_s / (predicted.wall_s - start)
    measured_run = measured * cal.summary.wall_s / (cal.summary.wall_s - start)
    print(f"{strategy} after the start: predicted {pred_run:.4f}, measured {measured_run:.4f}")
    assert pred_run == pytest.approx(measured_run, abs=0.03), (pred_run, measured_run)
