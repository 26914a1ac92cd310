"""The measured and predicted goodput of ``bench/sim_validation.py``'s runs, from their raw
records: the estimator, the calibration of each system, and the simulator's prediction
(the bench's docstring states them)."""

from __future__ import annotations

import gzip
import itertools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import common

__all__ = [
    "SETTLE_S",
    "TARGET_PP",
    "Case",
    "calibrate_planaria",
    "calibrate_torchrun",
    "harness_victims",
    "measured_goodput",
    "micro_batches_per_rank",
    "predict",
    "scaled_to",
    "step_s_by_width",
]

SETTLE_S = 5.0
"""Gaps this soon after a kill are not fault-free (the recovery, the replacement's start)."""
TARGET_PP = 3.0


@dataclass(frozen=True, kw_only=True)
class Case:
    """One real run: its system, its fault rate, step length and checkpoint interval."""

    name: str
    system: str  # "planaria" or "torchrun"
    kill_every_s: float
    ckpt_every: int
    sleep_s: float = 0.0
    calibration: bool = False


def micro_batches_per_rank(width: int) -> int:
    return -(-common.GLOBAL_BATCH // common.MICRO_BATCH // width)


# ---- measured and predicted ----------------------------------------------------------------

def _fault_free_period(window: list[dict[str, Any]], kills: list[float], replicas: int
                       ) -> float | None:
    gaps = [b["wall"] - a["wall"] for a, b in itertools.pairwise(window)
            if b["step"] == a["step"] + 1 and a["width"] >= replicas <= b["width"]
            and not any(a["wall"] - SETTLE_S < k <= b["wall"] for k in kills)]
    return sum(gaps) / len(gaps) if gaps else None


def measured_goodput(rec: dict[str, Any]) -> dict[str, Any]:
    """The module docstring's estimator over one run's raw records."""
    t0, t1, replicas = rec["t0"], rec["t1"], rec["replicas"]
    commits = sorted(rec["commits"], key=lambda c: c["wall"])
    window = [c for c in commits if t0 < c["wall"] <= t1]
    kills = [k["t_kill"] for k in rec["kills"] if t0 <= k["t_kill"] <= t1]
    high = max((c["step"] for c in commits if c["wall"] <= t0), default=-1)
    useful = 0
    for c in window:
        if c["step"] > high:
            useful, high = useful + 1, c["step"]
    period = _fault_free_period(window, kills, replicas)
    return {"goodput": useful * period / (t1 - t0) if period else None, "useful_steps": useful,
            "period_s": period, "kills": len(kills)}


def _log_rows(raw: Path, rec: dict[str, Any]) -> list[dict[str, Any]]:
    path = raw / rec["case"]["name"] / rec["log"]
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def calibrate_planaria(raw: Path, rec: dict[str, Any]) -> dict[str, Any]:
    """The simulator's figures from the calibration run's event log; detection and rebuild
    counted from the harness's SIGKILL (the replayed failures strike at the kill, while the
    event log's ``detect_s`` starts at planaria's own, earlier, estimate of the fault)."""
    import statistics

    from planaria.sim.calibrate import calibrate

    rows = _log_rows(raw, rec)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cal = calibrate(tmp)
    keep = ("step_overhead_s", "detect_s", "rebuild_s", "replacement_s", "join_stall_s",
            "ckpt_stall_s", "ckpt_write_s")
    figures = {k: cal.figures[k] or 0.0 for k in keep}
    # When every replica is lost the job restores its last save; a run that never did
    # gives no restore time: assumed as long as writing one.
    figures["restore_s"] = cal.figures["restore_s"] or (
        figures["ckpt_stall_s"] + figures["ckpt_write_s"])
    detected = sorted(r["t"] for r in rows if r["event"] == "detected")
    begun = sorted(r["t"] - r["duration_s"] for r in rows if r["event"] == "step_committed")
    detect, rebuild = [], []
    for kill in rec["kills"]:
        seen = next((t for t in detected if t > kill["t_kill"]), None)
        start = next((t for t in begun if seen is not None and t > seen), None)
        if seen is not None and start is not None:
            detect.append(seen - kill["t_kill"])
            rebuild.append(start - seen)
    if detect:
        figures.update(detect_s=statistics.median(detect), rebuild_s=statistics.median(rebuild))
    return {**figures, "step_s": cal.params.step_s,
            "step_s_by_width": {cal.params.replicas: cal.params.step_s,
                                **dict(cal.params.step_s_by_width)}}


def calibrate_torchrun(raw: Path, rec: dict[str, Any]) -> dict[str, Any]:
    """The simulator's restart figures from the calibration run's torchrun log."""
    import statistics

    rows = _log_rows(raw, rec)
    steps = [r for r in rows if r["event"] == "step"]
    saves = {r["step"] for r in rows if r["event"] == "ckpt"}  # the next step to run
    plain, with_save = [], []
    for a, b in itertools.pairwise(steps):
        if b["step"] == a["step"] + 1 and b["restart"] == a["restart"]:
            (with_save if b["step"] in saves else plain).append(b["wall"] - a["wall"])
    step_s = statistics.fmean(plain)
    detect, restart = [], []
    for kill in rec["kills"]:
        launches = [r["launched_wall"] for r in rows if r["event"] == "start"
                    and r["wall"] > kill["t_kill"]]
        if not launches:
            continue
        launch = min(launches)
        first = next((s for s in steps if s["wall"] > launch), None)
        detect.append(launch - kill["t_kill"])
        if first is not None:
            restart.append(first["wall"] - first["step_ms"] / 1000 - launch)
    return {"step_s": step_s, "step_overhead_s": 0.0,
            "ckpt_stall_s": max(statistics.fmean(with_save) - step_s, 0.0) if with_save else 0.0,
            "ckpt_write_s": 0.0, "restore_s": 0.0, "replacement_s": 0.0,
            "detect_s": statistics.median(detect), "restart_s": statistics.median(restart)}


def step_s_by_width(rec: dict[str, Any]) -> dict[int, float]:
    """A run's mean step period at each width (consecutive commits, no kill between)."""
    commits = sorted(rec["commits"], key=lambda c: c["wall"])
    kills = [k["t_kill"] for k in rec["kills"]]
    gaps: dict[int, list[float]] = {}
    for a, b in itertools.pairwise(commits):
        if (rec["t0"] < a["wall"] and b["step"] == a["step"] + 1 and a["width"] == b["width"]
                and not any(a["wall"] < k <= b["wall"] for k in kills)):
            gaps.setdefault(int(b["width"]), []).append(b["wall"] - a["wall"])
    return {w: sum(g) / len(g) for w, g in gaps.items()}


def harness_victims(kill_at_s: list[float], replicas: int, out_s: float) -> tuple[int, ...]:
    """The replica each kill takes, as the harness picks: one in service (a replica is out
    for ``out_s`` after its kill); all in service are alike, so the first. With none in
    service, the longest out (the simulator ignores a failure of a replica already out)."""
    back = [0.0] * replicas
    picked = []
    for t in kill_at_s:
        live = [r for r in range(replicas) if back[r] <= t]
        r = live[0] if live else min(range(replicas), key=lambda i: back[i])
        back[r] = t + out_s
        picked.append(r)
    return tuple(picked)


_TIMES = ("step_s", "step_overhead_s", "detect_s", "rebuild_s", "replacement_s",
          "join_stall_s", "ckpt_stall_s", "ckpt_write_s", "restore_s", "restart_s")


def scaled_to(cal: dict[str, Any], case: Case, rec: dict[str, Any]) -> dict[str, Any]:
    """Every calibrated time times the held-out run's fault-free step (less its sleep) over
    the calibration's: on a shared CPU machine everything slows with the load together."""
    period = measured_goodput(rec)["period_s"]
    compute = period - case.sleep_s * micro_batches_per_rank(rec["replicas"])
    k = compute / (cal["step_s"] + cal["step_overhead_s"])
    out = {key: (v * k if key in _TIMES else v) for key, v in cal.items()}
    if "step_s_by_width" in cal:
        out["step_s_by_width"] = {w: s * k for w, s in cal["step_s_by_width"].items()}
    return out


def predict(cal: dict[str, Any], case: Case, kill_at_s: list[float], duration_s: float,
            replicas: int, steps: dict[int, float] | None = None) -> float:
    """Simulated steps with the kills ÷ without, over the window (module docstring).
    ``steps``: the run's own step period at each width instead of the calibration's
    (plus the case's sleep); a width it lacks keeps the calibration's ratio to full."""
    from planaria.sim import FailureTrace, SimParams, simulate

    overhead = cal["step_overhead_s"]
    cal_by_width = {int(w): s for w, s in (cal.get("step_s_by_width") or {}).items()}
    cal_by_width.setdefault(replicas, cal["step_s"])
    if steps and replicas in steps:
        full = steps[replicas] - overhead
        by_width = {w: steps.get(w, full * s / cal["step_s"] + overhead) - overhead
                    for w, s in cal_by_width.items()}
    else:
        by_width = {w: s + case.sleep_s * micro_batches_per_rank(w)
                    for w, s in cal_by_width.items()}
    step_s = by_width.pop(replicas)
    figures = {k: v for k, v in cal.items() if k not in ("step_s", "step_s_by_width")}
    strategy = "resize" if case.system == "planaria" else "restart"
    base = SimParams(nodes=replicas, gpus_per_node=1, node_mtbf_h=1e9, step_s=step_s,
                     step_s_by_width=tuple(sorted(by_width.items())),
                     days=duration_s / 86_400.0, **figures)
    trace = FailureTrace(times=tuple(kill_at_s), replicas=harness_victims(
        kill_at_s, replicas, figures["detect_s"] + figures["replacement_s"]))
    interval = case.ckpt_every * step_s
    faulty = simulate(base.with_(trace=trace), strategy, interval_s=interval)
    clean = simulate(base.with_(trace=FailureTrace(times=(), replicas=())), strategy,
                     interval_s=interval)
    return faulty.steps / clean.steps
