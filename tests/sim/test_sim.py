"""The simulator: closed-form cases, seeds, errors, Daly's optimum, the plan command."""

from __future__ import annotations

import json
import math
import time

import pytest

from planaria.checkpoint.interval import young_daly_interval
from planaria.faults.errors import ConfigError
from planaria.sim import FailureTrace, SimParams, simulate
from planaria.sim.search import best_interval, evaluate, plan

NO_FAILURES = 1e12  # hours


def one_failure(at: float, **extra: float) -> SimParams:
    """3 replicas, 100 steps of 1 s, free saves every 10 steps, one loss at ``at`` s."""
    figures = dict(detect_s=1.0, rebuild_s=2.0, replacement_s=10.0, restart_s=5.0,
                   restore_s=3.0, join_stall_s=0.5, ckpt_stall_s=0.0, ckpt_write_s=0.0)
    figures.update(extra)
    return SimParams(nodes=3, step_s=1.0, steps=100, node_mtbf_h=NO_FAILURES,
                     trace=FailureTrace(times=(at,), replicas=(1,)), **figures)


def test_no_failures_goodput_is_compute_over_compute_plus_stalls():
    p = SimParams(nodes=4, step_s=1.0, steps=100, node_mtbf_h=NO_FAILURES, ckpt_stall_s=2.0)
    r = simulate(p, "restart", interval_s=10)
    assert r.failures == 0 and r.checkpoints == 9  # not after the last step
    assert r.goodput == pytest.approx(100 / (100 + 9 * 2.0))
    horizon = SimParams(nodes=4, step_s=1.0, days=1, node_mtbf_h=NO_FAILURES, ckpt_stall_s=2.0)
    for strategy in ("restart", "restore", "pause", "resize"):
        assert simulate(horizon, strategy, interval_s=98).goodput == pytest.approx(
            98 / 100, abs=1e-4)


@pytest.mark.parametrize(
    ("strategy", "wall", "buckets"),
    [
        # lost 25.5 - 20 (the last save), detect 1, wait for the node to 40.5, restart, restore
        ("restart", 100 + 5.5 + 1 + 10 + 5 + 3,
         {"wasted_steps": 5.5, "recovery": 1, "downtime": 10, "startup": 5, "restore": 3}),
        # no restart; detect + tear down 3, wait 8 more for the replacement, restore
        ("restore", 100 + 5.5 + 3 + 8 + 3,
         {"wasted_steps": 5.5, "recovery": 3, "waiting_for_replicas": 8, "restore": 3}),
        # only the half step in flight is lost; wait at full stop, then the join
        ("pause", 100 + 0.5 + 1 + 10 + 0.5,
         {"wasted_steps": 0.5, "recovery": 1, "waiting_for_replicas": 10.5}),
        # detect + rebuild 3, 8 s at width 2 (1.5 s steps), the join's 0.5 s stall
        ("resize", 100 + 0.5 + 3 + 8 * (0.5 / 1.5) + 0.5,
         {"wasted_steps": 0.5, "recovery": 3.5, "reduced_width": 8 * 0.5 / 1.5}),
    ],
)
def test_one_failure_at_a_known_time_costs_exactly(strategy, wall, buckets):
    r = simulate(one_failure(25.5), strategy, interval_s=10)
    assert r.wall_s == pytest.approx(wall)
    assert r.goodput_s == pytest.approx(100.0)
    for name, seconds in buckets.items():
        assert r.badput_s[name] == pytest.approx(seconds), name
    assert r.goodput_s + sum(r.badput_s.values()) == pytest.approx(r.wall_s)


def test_a_checkpoint_counts_only_once_written():
    # The save after step 20 is written at 20 + 0 + 10 s: a loss at 25.5 goes back to step 10.
    r = simulate(one_failure(25.5, ckpt_write_s=10.0), "restore", interval_s=10)
    assert r.badput_s["wasted_steps"] == pytest.approx(15.5)


def test_a_failure_given_by_step_strikes_when_the_job_gets_there():
    trace = FailureTrace(times=(25.0,), replicas=(1,), unit="step")
    slow = one_failure(0).with_(trace=trace, startup_s=50.0)
    r = simulate(slow, "restore", interval_s=10)
    assert r.badput_s["wasted_steps"] == pytest.approx(5.0)  # steps 20-24, whatever the start
    assert r.wall_s == pytest.approx(50 + 100 + 5 + 3 + 8 + 3)


def test_hot_spares_shorten_the_wait():
    r = simulate(one_failure(25.5, spares=1, spare_swap_s=2.0), "pause", interval_s=10)
    assert r.badput_s["waiting_for_replicas"] == pytest.approx(2.0 + 0.5)


def test_losing_every_replica_falls_back_to_a_restore():
    p = one_failure(25.5).with_(
        trace=FailureTrace(times=(25.5, 26.0, 26.5), replicas=(0, 1, 2)))
    r = simulate(p, "resize", interval_s=10)
    assert r.badput_s["restore"] == pytest.approx(3.0)
    assert r.badput_s["wasted_steps"] > 5  # back to the save after step 20


def test_a_node_failure_takes_its_whole_replica_out():
    p = SimParams(nodes=8, nodes_per_replica=4, step_s=1.0, steps=50, node_mtbf_h=NO_FAILURES,
                  trace=FailureTrace(times=(10.5,), replicas=(1,)), replacement_s=20.0,
                  detect_s=0.0, rebuild_s=0.0, join_stall_s=0.0)
    r = simulate(p, "resize", interval_s=None)
    assert r.badput_s["reduced_width"] == pytest.approx(20.0 * 0.5)  # half the job for 20 s


def test_a_preemption_with_notice_loses_nothing():
    trace = FailureTrace(times=(25.5,), replicas=(1,), planned=(True,))
    p = one_failure(25.5).with_(trace=trace, preempt_notice_s=60.0)
    assert simulate(p, "resize", interval_s=10).badput_s["wasted_steps"] == 0.0
    assert simulate(p, "restart", interval_s=10).badput_s["wasted_steps"] == 0.0


def test_same_seed_same_result_and_fast_at_fleet_scale():
    p = SimParams(nodes=2048, node_mtbf_h=6350.0, days=30, replacement_cv=0.5,
                  preempt_mtbf_h=20_000.0, spares=4)
    t0 = time.perf_counter()
    a = simulate(p, "restart", interval_s=600, seed=7)
    assert time.perf_counter() - t0 < 5.0  # 30 days on 16,384 GPUs
    b = simulate(p, "restart", interval_s=600, seed=7)
    c = simulate(p, "restart", interval_s=600, seed=8)
    assert a == b and a.goodput != c.goodput
    assert 150 < a.failures < 350  # 30 days x 24 h x 2048 / 6350 h ≈ 232, plus preemptions
    assert a.goodput_s + sum(a.badput_s.values()) == pytest.approx(a.wall_s)


def test_weibull_shape_one_is_exponential_on_average():
    p = SimParams(nodes=512, node_mtbf_h=1000.0, days=60)
    n_exp = evaluate(p, "resize", 3600, seeds=range(4)).failures
    n_wei = evaluate(p.with_(weibull_shape=0.7), "resize", 3600, seeds=range(4)).failures
    expected = 60 * 24 * 512 / 1000
    assert n_exp == pytest.approx(expected, rel=0.1)
    assert n_wei > 0


def test_best_interval_agrees_with_daly_where_his_assumptions_hold():
    # Exponential failures, a fixed save cost, instant replacement: Daly's model.
    p = SimParams(nodes=64, node_mtbf_h=64 * 2.0, days=120, step_s=1.0, ckpt_stall_s=60.0,
                  ckpt_write_s=0.0, detect_s=0.0, replacement_s=0.0, restart_s=0.0,
                  restore_s=60.0)
    daly = young_daly_interval(60.0, p.job_mtbf_s)
    found = best_interval(p, "restart", seeds=(0, 1, 2, 3))
    assert 0.7 < found.interval_s / daly < 1.4
    at_daly = evaluate(p, "restart", daly, seeds=(0, 1, 2, 3))
    assert found.goodput - at_daly.goodput < 0.002


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"nodes": 0}, "nodes"),
        ({"node_mtbf_h": -1.0}, "node_mtbf_h"),
        ({"step_s": 0.0}, "step_s"),
        ({"replacement_s": -5.0}, "replacement_s"),
        ({"preempt_mtbf_h": 0.0}, "preempt_mtbf_h"),
        ({"nodes": 10, "nodes_per_replica": 4}, "nodes"),
        ({"weibull_shape": float("nan")}, "weibull_shape"),
        ({"spares": -1}, "spares"),
    ],
)
def test_impossible_parameters_are_refused_by_name(changes, field):
    with pytest.raises(ConfigError, match=field):
        SimParams(**{"nodes": 8, **changes})


def test_bad_strategy_and_interval_are_refused():
    p = SimParams(nodes=8)
    with pytest.raises(ConfigError, match="strategy"):
        simulate(p, "retry", interval_s=60)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="interval_s"):
        simulate(p, "resize", interval_s=-1)
    with pytest.raises(ConfigError, match="replicas"):
        SimParams(nodes=2, trace=FailureTrace(times=(1.0,), replicas=(5,)))
    with pytest.raises(ConfigError, match="times"):
        FailureTrace(times=(-1.0,), replicas=(0,))


def test_plan_ranks_strategies_and_explains():
    p = SimParams(nodes=256, node_mtbf_h=256 * 4.0, days=10)
    result = plan(p, seeds=(0,), refine=2)
    out = result.to_json()
    assert set(out["strategies"]) == {"restart", "restore", "pause", "resize"}
    best = max(out["strategies"], key=lambda s: out["strategies"][s]["goodput"])
    assert out["recommended"] == best and best in out["why"]
    for s in out["strategies"].values():
        assert 0 < s["goodput"] <= 1 and math.isfinite(s["interval_s"])
        assert s["goodput"] + sum(s["badput"].values()) == pytest.approx(1.0)


def test_plan_command_prints_one_json_object(capsys, tmp_path):
    from planaria.cli.main import main

    png = tmp_path / "sizes.png"
    code = main(["plan", "--nodes", "64", "--node-mtbf-hours", "500", "--days", "5",
                 "--seeds", "1", "--json", "--png", str(png)])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["recommended"] in out["strategies"] and png.stat().st_size > 0
    assert main(["plan", "--nodes", "0"]) == 2


def synthetic_run(run_dir) -> None:
    """2 replicas, 10 steps of 1 s; w1 dies in step 4 and w2 replaces it, joining at step 7."""
    recs = [{"t": 100.0, "event": "run_start", "replicas": 2, "steps": 10,
             "config": {"on_worker_lost": "resize"}}]
    t, width = 105.0, 2
    for step in range(10):
        if step == 4:
            recs += [
                {"t": t + 0.5, "event": "fault", "fault_id": 0, "kind": "worker_lost",
                 "worker": "w1", "step": 4, "fault_t": t + 0.3},
                {"t": t + 0.5, "event": "detected", "fault_id": 0, "detect_s": 0.2},
                {"t": t + 0.5, "event": "replacement_requested", "worker": "w2",
                 "replaces": "w1"},
                {"t": t + 0.5, "event": "action", "fault_id": 0, "action": "resize"},
            ]
            t, width = t + 0.5 + 0.3, 1  # rebuilt 0.3 s after detection
        joining = step == 7
        if joining:
            recs.append({"t": t, "event": "replacement_ready", "worker": "w2",
                         "replacement_s": 2.0})
            t, width = t + 0.4, 2  # the join's stall
        t += 1.0 if width == 2 else 1.5
        recs.append({"t": t, "event": "step_committed", "step": step, "gen": int(step >= 4)
                     + int(step >= 7), "width": width, "duration_s": 1.0 if width == 2 else 1.5})
        if step == 4:
            recs.append({"t": t, "event": "recovered", "fault_id": 0, "step": 4,
                         "recover_s": t - 105.3 - 4, "lost_steps": 0})
        if joining:
            recs.append({"t": t, "event": "joined", "worker": "w2", "gen": 2, "step": 7,
                         "join_s": 1.4})
    recs.append({"t": t + 0.5, "event": "run_end", "status": "ok", "step": 10})
    (run_dir / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_calibration_reads_the_figures_of_an_event_log(tmp_path, capsys):
    from planaria.cli.main import main
    from planaria.sim.calibrate import calibrate

    synthetic_run(tmp_path)
    cal = calibrate(tmp_path)
    f = cal.figures
    assert cal.strategy == "resize" and cal.interval_s is None
    assert f["step_s"] == pytest.approx(1.0) and f["detect_s"] == pytest.approx(0.2)
    assert f["rebuild_s"] == pytest.approx(0.3) and f["replacement_s"] == pytest.approx(2.0)
    assert f["join_stall_s"] == pytest.approx(0.4) and f["startup_s"] == pytest.approx(5.0)
    assert dict(cal.params.step_s_by_width) == {1: pytest.approx(1.5)}
    assert cal.params.trace.times == (4.0,) and cal.params.trace.unit == "step"
    predicted = simulate(cal.params, cal.strategy, interval_s=None)
    measured = cal.measured_goodput
    pred = predicted.goodput + predicted.badput["reduced_width"]
    assert pred == pytest.approx(measured, abs=0.03)
    assert main(["plan", "--from-run", str(tmp_path), "--nodes", "64", "--days", "2",
                 "--node-mtbf-hours", "100",
                 "--seeds", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recommended"] in ("pause", "resize")
