"""The simulator validated out of sample: calibrated once on one real run, it predicts the
goodput of other real runs that differ in fault rate, step length and checkpoint interval.

    python bench/sim_validation.py                # 5 planaria + 3 torchrun runs: ~15 min
    python bench/sim_validation.py --quick        # smoke: 2 short runs, ~3 min, to a temp dir
    python bench/sim_validation.py --from-raw DIR # the figures again from DIR's raw records

What is run. Short real jobs of ``bench.common``'s workload (``--size``, 3 replicas, one
torch thread each) while ``bench/kill_harness.py`` SIGKILLs one active training worker
every ``kill_every_s`` (seeded schedule, ``--seed``), for a window of ``--duration-s``
after a 3-step warm-up: planaria (resize policy, replacements hot-join, a sharded save
every ``ckpt_every`` steps) and torchrun (DDP, a checkpoint every ``ckpt_every`` steps,
every kill restarts all workers, ``bench.baselines.runners.run_torchrun_faults``). The
step length is changed with a sleep in the model's forward (``sleep_s`` a micro-batch).
The runs are interleaved in one sequence, the calibration run among the held-out ones,
so that they share the machine's load as nearly as can be.

Calibration, once per system, on its calibration run only:

- planaria: :func:`planaria.sim.calibrate.calibrate` over the run's ``events.jsonl``
  (step time at each width, step overhead, detect, rebuild, replacement, join stall,
  save stall and write);
- torchrun: from its log (``calibrate_torchrun``): the step time, the save's extra
  time, kill → the new round's processes launched (``detect_s``), and launch → the
  new round's first step begun (``restart_s``: start-up, rendezvous, load).

Prediction for a held-out run, from those figures and the run's *configuration* only
(nothing measured in it): its kill schedule (the harness's seeded plan, known before
the run), its checkpoint interval, and its step length: the calibration's step times
plus the added sleep times the micro-batches a rank runs at each width. The simulator
replays the planned kills (by time, from the window's start) over the window and over
the same window without kills; **predicted goodput** = simulated steps with kills ÷
simulated steps without. ``predicted_at_kills`` replays the kills when they were sent
instead (a system still restarting is killed later than planned: an input the harness
records, still no cost of the run).

**Measured goodput** (one estimator, stated before the runs): the window's useful steps
(first commits of steps beyond every step committed before) times the fault-free step
period, over the window; the fault-free period is the mean gap between consecutive
full-width commits with no kill between them and none in the 5 s before (saves
included: what the system pays without faults), pooled over the window (the windows
are short). ``error_pp`` = 100 x |predicted - measured|; ``within_target``: the held-out runs
within 3 points; ``met``: every held-out run within 3 points, and at least three.

The machine: the development machine is shared and loaded (its load average is
recorded before and after every run); the figures are labelled ``loaded machine``
unless ``--label`` says otherwise. Raw records (each run's commits, kills and window,
its event log or training log gzipped, the calibration, the result) go to
``--raw-dir`` (default ``bench/results/raw/sim_validation/<commit>/``; a temp dir with
``--quick``). The last line printed is one JSON object: ``{"bench": "sim_validation",
"commit", "label", "calibrated_on", "held_out": [{"run", "measured", "predicted",
"error_pp", ...}], "max_error_pp", "met"}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from bench import common  # noqa: E402
from bench.kill_harness import (  # noqa: E402
    JsonlTail,
    KillHarness,
    PlannedKill,
    plan_kills,
    step_period_s,
)
from bench.sim_predict import (  # noqa: E402
    TARGET_PP,
    Case,
    calibrate_planaria,
    calibrate_torchrun,
    measured_goodput,
    predict,
    scaled_to,
    step_s_by_width,
)

__all__ = ["FULL", "QUICK", "main", "make_sleepy_model", "run_planaria", "run_torchrun"]

_ENDLESS = 10**9

FULL: tuple[Case, ...] = (  # interleaved: each calibration run among its held-out runs
    Case(name="planaria_kill10", system="planaria", kill_every_s=10, ckpt_every=20),
    Case(name="torchrun_kill10", system="torchrun", kill_every_s=10, ckpt_every=10),
    Case(name="planaria_kill20", system="planaria", kill_every_s=20, ckpt_every=20,
         calibration=True),
    Case(name="torchrun_kill20", system="torchrun", kill_every_s=20, ckpt_every=10,
         calibration=True),
    Case(name="planaria_kill40", system="planaria", kill_every_s=40, ckpt_every=20),
    Case(name="planaria_kill20_sleep", system="planaria", kill_every_s=20, ckpt_every=20,
         sleep_s=0.1),
    Case(name="torchrun_kill20_ckpt40", system="torchrun", kill_every_s=20, ckpt_every=40),
    Case(name="planaria_kill20_ckpt5", system="planaria", kill_every_s=20, ckpt_every=5),
)
QUICK: tuple[Case, ...] = (
    Case(name="planaria_kill10", system="planaria", kill_every_s=10, ckpt_every=20,
         calibration=True),
    Case(name="planaria_kill10_sleep", system="planaria", kill_every_s=10, ckpt_every=20,
         sleep_s=0.1),
)


# ---- the workload with a longer step ------------------------------------------------------

def _sleep_hook(sleep_s: float, module: Any, args: Any) -> None:
    time.sleep(sleep_s)


def make_sleepy_model(size: str, sleep_s: float) -> Any:
    """``bench.common``'s model that sleeps ``sleep_s`` in each forward (one micro-batch)."""
    model = common.make_model(size)
    if sleep_s > 0:
        model.register_forward_pre_hook(functools.partial(_sleep_hook, sleep_s))
    return model


# ---- the runs -----------------------------------------------------------------------------

def _planned(case: Case, args: argparse.Namespace) -> list[PlannedKill]:
    return plan_kills(args.seed, case.kill_every_s, args.duration_s)


def _worker_path() -> None:
    """Ray workers inherit this environment: let them import ``bench`` too."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(_REPO) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(_REPO), *parts])


def run_planaria(case: Case, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """``bench/planaria_side.run_planaria_faults``' loop with saves and the sleepy model."""
    import planaria
    from bench.planaria_side import make_spec, planaria_victims
    from planaria import RecoveryPolicy, RunConfig
    from planaria.checkpoint.config import CheckpointConfig

    _worker_path()
    spec = dataclasses.replace(make_spec(args.size),
                               model=functools.partial(make_sleepy_model, args.size, case.sleep_s))
    config = RunConfig(steps=_ENDLESS, replicas=args.replicas, run_dir=run_dir,
                       threads_per_worker=1)
    policy = RecoveryPolicy(on_worker_lost="resize", min_replicas=1, max_failures=_ENDLESS)
    ckpt = CheckpointConfig(root=str(run_dir / "checkpoints"), every=case.ckpt_every,
                            resume=False, fsync=False, keep_last=2)
    harness = KillHarness(_planned(case, args))
    tail = JsonlTail(run_dir / "events.jsonl")

    def commits() -> list[tuple[int, float]]:
        return [(r["step"], r["t"]) for r in tail.read() if r.get("event") == "step_committed"]

    def advance(job: Any, until: int) -> None:
        try:
            job.run_steps(until)
        except planaria.Failure as failure:
            job.recovery.handle(failure)

    with planaria.Job(spec, config, policy=policy, checkpoint=ckpt) as job:
        while job.steps_done < 3:
            advance(job, 3)
        t0 = time.time()
        t1 = t0 + args.duration_s
        harness.start(t0, victims=lambda: planaria_victims(tail),
                      step_s=lambda: step_period_s(commits()))
        try:
            while (now := time.time()) < t1:
                period = step_period_s(commits()) or 0.1
                advance(job, job.steps_done + max(1, int(min(t1 - now, 5.0) / period)))
        finally:
            harness.stop()
    rows = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
            if line.strip()]
    return {"commits": [{"step": e["step"], "wall": e["t"], "width": e["width"],
                         "started": e["t"] - e["duration_s"]}
                        for e in rows if e.get("event") == "step_committed"],
            "t0": t0, "t1": t1, "kills": harness.kills, "skipped_kills": harness.skipped,
            "log": "events.jsonl"}


def run_torchrun(case: Case, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    from bench.baselines.runners import run_torchrun_faults

    if case.sleep_s:
        raise SystemExit(f"{case.name}: the torchrun runner has no per-step sleep")
    run = run_torchrun_faults(args.duration_s, KillHarness(_planned(case, args)), args.size,
                              args.replicas, ckpt_every=case.ckpt_every, workdir=run_dir)
    return {**run, "log": Path(run["log"]).name}


def record(case: Case, args: argparse.Namespace, raw: Path) -> dict[str, Any]:
    """Runs ``case`` and keeps its raw records in ``raw/<name>/``; returns them."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"simval_{case.name}_"))
    load_before = os.getloadavg()
    started = time.time()
    runner = run_planaria if case.system == "planaria" else run_torchrun
    run = runner(case, args, run_dir)
    out = raw / case.name
    out.mkdir(parents=True, exist_ok=True)
    with open(run_dir / run["log"], "rb") as src, \
            gzip.open(out / (run["log"] + ".gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    rec = {"case": dataclasses.asdict(case), "duration_s": args.duration_s, "seed": args.seed,
           "size": args.size, "replicas": args.replicas, "commits": run["commits"],
           "t0": run["t0"], "t1": run["t1"], "kills": run["kills"],
           "skipped_kills": run["skipped_kills"], "log": run["log"] + ".gz",
           "run_wall_s": round(time.time() - started, 1),
           "load_before": load_before, "load_after": os.getloadavg()}
    (out / "run.json").write_text(json.dumps(rec, default=str))
    shutil.rmtree(run_dir, ignore_errors=True)
    return rec


# ---- the bench -----------------------------------------------------------------------------

def _commit_id() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_REPO, text=True,
                         capture_output=True, check=False)
    return out.stdout.strip() or "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke: 2 runs of 30 s, to a temp dir")
    p.add_argument("--duration-s", type=float, default=None, help="window per run (90; quick 30)")
    p.add_argument("--size", default="small", help="bench.common model size")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="the kill schedules' seed")
    p.add_argument("--raw-dir", type=Path, default=None,
                   help="raw records (default bench/results/raw/sim_validation/<commit>/)")
    p.add_argument("--from-raw", type=Path, default=None, metavar="DIR",
                   help="run nothing: the figures again from DIR's raw records")
    p.add_argument("--label", default="loaded machine", help="the machine's state, printed")
    args = p.parse_args(argv)
    if args.duration_s is None:
        args.duration_s = 30.0 if args.quick else 90.0
    return args


def _cases(args: argparse.Namespace) -> tuple[Case, ...]:
    return QUICK if args.quick else FULL


def _kill_times(rec: dict[str, Any], period_s: float, planned: bool) -> list[float]:
    if planned:
        case = Case(**rec["case"])
        return [k.at_s + k.step_fraction * period_s
                for k in plan_kills(rec["seed"], case.kill_every_s, rec["duration_s"])]
    return [k["t_kill"] - rec["t0"] for k in rec["kills"]
            if rec["t0"] <= k["t_kill"] <= rec["t1"]]


def evaluate(raw: Path, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Calibrates on each system's calibration run; predicts and scores the others."""
    cals: dict[str, dict[str, Any]] = {}
    calibrated_on: dict[str, str] = {}
    for name, rec in records.items():
        case = Case(**rec["case"])
        if case.calibration:
            calibrate = calibrate_planaria if case.system == "planaria" else calibrate_torchrun
            cals[case.system] = calibrate(raw, rec)
            calibrated_on[case.system] = name
    rows = []
    for name, rec in records.items():
        case = Case(**rec["case"])
        cal = cals.get(case.system)
        measured = measured_goodput(rec)
        if cal is None or measured["goodput"] is None:
            continue
        period = cal["step_s"] + cal["step_overhead_s"]
        sent = _kill_times(rec, period, planned=False)
        pred = predict(cal, case, sent, rec["duration_s"], rec["replicas"])
        planned = predict(cal, case, _kill_times(rec, period, planned=True), rec["duration_s"],
                          rec["replicas"])
        given = predict(cal, case, sent, rec["duration_s"], rec["replicas"],
                        steps=step_s_by_width(rec))
        scaled = predict(scaled_to(cal, case, rec), case, sent, rec["duration_s"],
                         rec["replicas"])
        good = measured["goodput"]
        rows.append({
            "run": name, "system": case.system, "calibration": case.calibration,
            "kill_every_s": case.kill_every_s, "ckpt_every": case.ckpt_every,
            "sleep_s": case.sleep_s, "kills": measured["kills"],
            "step_ms": round(1000 * measured["period_s"], 2),
            "step_ms_by_width": {w: round(1000 * s, 1)
                                 for w, s in sorted(step_s_by_width(rec).items())},
            "measured": round(good, 4), "predicted": round(pred, 4),
            "error_pp": round(100 * abs(pred - good), 2),
            "predicted_planned_kills": round(planned, 4),
            "error_pp_planned_kills": round(100 * abs(planned - good), 2),
            "predicted_load_scaled": round(scaled, 4),
            "error_pp_load_scaled": round(100 * abs(scaled - good), 2),
            "predicted_given_steps": round(given, 4),
            "error_pp_given_steps": round(100 * abs(given - good), 2),
            "load_before": [round(x, 2) for x in rec["load_before"]],
            "load_after": [round(x, 2) for x in rec["load_after"]]})
    held = [r for r in rows if not r["calibration"]]
    worst = max((r["error_pp"] for r in held), default=None)
    return {"calibrated_on": calibrated_on, "calibration": cals, "rows": rows,
            "held_out": held, "max_error_pp": worst,
            "within_target": sum(r["error_pp"] <= TARGET_PP for r in held),
            "met": bool(len(held) >= 3 and worst is not None and worst <= TARGET_PP)}


def table(result: dict[str, Any], label: str) -> list[str]:
    head = (f"{'run':24s} {'role':10s} {'kills':>5s} {'step ms':>8s} {'measured':>8s} "
            f"{'predicted':>9s} {'err pp':>6s} {'planned':>8s} {'err pp':>6s} "
            f"{'scaled':>8s} {'err pp':>6s}  load 1-min")
    lines = [f"simulator out of sample ({label}); calibrated on "
             f"{', '.join(result['calibrated_on'].values())}", head]
    for r in result["rows"]:
        role = "calibrate" if r["calibration"] else "held out"
        lines.append(f"{r['run']:24s} {role:10s} {r['kills']:5d} {r['step_ms']:8.1f} "
                     f"{r['measured']:8.4f} {r['predicted']:9.4f} {r['error_pp']:6.2f} "
                     f"{r['predicted_planned_kills']:8.4f} {r['error_pp_planned_kills']:6.2f} "
                     f"{r['predicted_load_scaled']:8.4f} {r['error_pp_load_scaled']:6.2f}  "
                     f"{r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f}")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    commit = _commit_id()
    started = time.time()
    if args.from_raw is not None:
        raw = args.from_raw
        records = {p.parent.name: json.loads(p.read_text())
                   for p in sorted(raw.glob("*/run.json"))}
    else:
        raw = args.raw_dir or (Path(tempfile.mkdtemp(prefix="simval_raw_")) if args.quick
                               else _REPO / "bench" / "results" / "raw" / "sim_validation" / commit)
        records = {}
        for case in _cases(args):
            print(f"running {case.name} ({args.duration_s:g} s window)", flush=True)
            records[case.name] = record(case, args, raw)
    result = evaluate(raw, records)
    for line in table(result, args.label):
        print(line)
    out = {"bench": "sim_validation", "commit": commit, "label": args.label,
           "calibrated_on": result["calibrated_on"],
           "held_out": [{k: r[k] for k in ("run", "measured", "predicted", "error_pp",
                                           "error_pp_planned_kills", "error_pp_load_scaled")}
                        for r in result["held_out"]],
           "max_error_pp": result["max_error_pp"], "within_target": result["within_target"],
           "met": result["met"],
           "raw_dir": str(raw), "wall_s": round(time.time() - started, 1)}
    (raw / "result.json").write_text(json.dumps({**out, "rows": result["rows"],
                                                 "calibration": result["calibration"]},
                                                indent=1, default=str))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
