"""Goodput under repeated faults: a SIGKILL every 30 s for 10 minutes, four systems, one harness.

    python bench/goodput.py                 # 600 s per run, "medium" model, sweeps: ~90 minutes
    python bench/goodput.py --quick         # smoke run: tiny model, 30 s per system, ~6 minutes
    python bench/goodput.py --from-runs --workdir DIR   # the figures again, from DIR's runs

What is measured. Each system trains the same workload (``bench.common``: the
same model, samples per step, global batch 48 in micro-batches of 8, Adam) on
``--replicas`` replicas (3) with 1 torch thread each, for a window of
``--duration-s`` (600 s), while one kill harness in this process
(``bench/kill_harness.py``) SIGKILLs one of its active training workers every
``--kill-every-s`` (30 s, moved by a seeded jitter of up to a quarter of that),
at a seeded random point of a step, the worker picked with a seeded draw among
the active ones (never a planaria standby spare, the torchft lighthouse,
torchrun's agent or Ray's own processes). ``--seed`` fixes the schedule, and
every system gets the same one. The window opens once a system has committed
``--warmup`` steps (and, with spares, once its spare stands by): start-up is
not measured.

The systems, each configured as its maintainers would for this fault rate:

- ``planaria_spares`` / ``planaria``: ``planaria.Job`` with
  ``RunConfig(replicas=3, spares=1 or 0)``, resize policy (survivors go on, a
  replacement, or the spare, hot-joins with the state from a survivor), the
  autonomous loop of ``fit()`` (``bench/planaria_side.run_planaria_faults``).
  The harness finds the members in the run's ``events.jsonl``: the latest
  ``generation`` record names them, ``worker_started`` records give their pids.
- ``torchft``: one replica group per process and a lighthouse
  (``--min_replicas 1``, ``--join_timeout_ms 10000``, as torchft's README runs
  it), torchft's asynchronous quorum (a replacement heals during its first step
  without taking part in it), a gloo timeout sized to the step (10 x the
  fault-free step time of planaria's run of the same workload, at least 2 s:
  ``--torchft-pg-timeout-s`` overrides), a killed group's replacement started
  at once; the lighthouse's heartbeat timeout is swept over
  ``--torchft-heartbeats-ms`` (250, 500, 1000; one run each) and the best run
  is reported (``runners.run_torchft_faults``).
- ``torchrun``: DDP with a checkpoint every N steps under ``torchrun
  --max-restarts``: a kill makes the agent restart every worker, which resume
  from the checkpoint. N is swept over ``--torchrun-ckpt-every`` (5, 10, 20;
  one run each) and the best run is reported; the Young/Daly interval
  ``sqrt(2 x save time x time between kills)`` from the measured save time is
  printed beside, to show the sweep brackets it (``runners.run_torchrun_faults``).

How the workload is sized, honestly. The default ``medium`` model takes 26-29 ms
a step (planaria, idle machine; 100 ms or more on a loaded one) with 3 replicas x
1 thread on the 2-core development machine; the 3 workers share 2 cores, so they
oversubscribe it, and the survivors of a kill get the core time the dead one
used: a missing replica costs less than a third of the throughput here (measured:
26 ms a step at width 3, 35-38 ms at width 2; on a machine with a core or a GPU
per replica it costs a third). How much it does cost is measured, not assumed:
``step_ms_by_width`` is each system's mean step time at each width it ran at.
Every process started after a kill (planaria's new standby spare or
replacement, torchft's replacement group, torchrun's restarted workers) also
runs on these 2 cores: starting one (Ray's worker or Python, importing torch,
building the model) slows the training steps beside it. Started cold, ~2
CPU-seconds a worker: measured for planaria with a spare, ~1 s of training time
lost per kill while the next spare started, against ~0.05 s when none was
started. planaria forks its workers from a server that imported torch once
(``RunConfig.warm_start``, on by default on one node; ``planaria.worker.forkserver``):
~0.7 CPU-seconds a start, the steps back at full speed ~2 s after a kill. The
peers start their processes as their maintainers do (a fresh Python each). On
a cluster a spare starts on resources of its own and that cost is not there.

Figures (per system, same definitions for all; times are ``time.time()`` in this
process and the workers, one clock). A *commit* is a step committed (planaria's
``step_committed``, rank 0's logged step under torchrun, the earliest group's
committed step under torchft); the window is ``[t0, t0 + duration_s]``.

- ``useful_steps``: steps committed in the window for the first time (a step
  beyond every step committed before); ``lost_steps``: commits in the window of
  steps committed before (recomputed work: torchrun's steps since the
  checkpoint); ``steps_committed``: both.
- fault-free step time: for each stretch of the window between kills, the mean
  time between full-width commits of consecutive steps, leaving out the 10 s
  after the kill that opens it (a stretch with fewer than 5 such gaps takes the
  whole window's mean; with fewer than 5 in the window, every full-width pair
  with no kill between counts). The mean, because n steps take n mean gaps (a
  median reads a run without faults below 1 when the gaps are skewed); per
  stretch, because this machine's speed drifts over ten minutes. What a system
  pays without faults is in it: torchrun's checkpoint saves, planaria's run
  boundaries. ``step_ms`` is its mean over the useful steps.
- ``goodput`` = the sum over useful steps of their stretch's fault-free step
  time, over the window (= ``useful_steps x step_ms / window``): the share of
  the window the system would have needed without faults for what it achieved.
- per kill, as in ``bench/baselines/runners.py``: ``s_max`` = highest step
  committed before the kill; ``recover_s`` = kill → next commit; ``mttr_s`` =
  ``back_s`` = kill → first commit of a step beyond ``s_max`` (new progress);
  ``full_width_s`` = kill → first commit at full width (every replica in);
  p50 and p99 over the kills (linear between closest ranks), each counting only
  commits inside the window. One refinement over runners.py, for every system:
  a step that was running when the kill came and still committed (its
  all-reduce was done before the kill) is progress made before the fault, not
  a recovery: it counts in ``s_max``, and "next commit" means the next commit
  of a step begun after the kill (each system logs when a step began: its
  commit time minus its own step duration). Without it a kill landing just
  after an all-reduce reads as a recovery in a few milliseconds.
- ``recoveries``: kills followed by new progress inside the window; ``kills``:
  kills sent; ``skipped_kills``: kills due while no worker was active (a system
  still restarting) until the next one was due.

planaria's runs also carry ``report``: ``planaria.observe.metrics.summarize`` over the
window's records of its own event log (its time-based goodput: committed steps'
time ÷ wall time, its badput buckets, recovered faults, and its own recover_s
and detect_s, which start at its estimate of the fault's time), and
``detect_s``: the harness's SIGKILL → planaria's ``fault`` record. Goodput can
exceed 1: when a system's steps at a reduced width are faster than its
full-width fault-free step (the cores, not the replicas, bound throughput), or
when the machine's load drops after the first kill. The ratios
``goodput_vs_torchft`` and ``goodput_vs_torchrun`` are planaria with spares
over each peer's best run. Targets: planaria with spares ≥ 0.95 and above each
peer's best.

The last line printed is one JSON object (``"bench": "goodput"``); without
``--quick`` it is also saved to ``bench/results/goodput.json`` and to the
``--workdir``. Each system's raw records (its commits, the kills, the window) are
kept in ``WORKDIR/<system>/bench_run.json`` beside its logs: ``--from-runs``
computes the figures again from them, running nothing (a change to how figures
are computed applies to runs already made).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from bench import common  # noqa: E402
from bench.baselines.runners import run_torchft_faults, run_torchrun_faults  # noqa: E402
from bench.kill_harness import KillHarness, plan_kills  # noqa: E402
from bench.planaria_side import run_planaria_faults  # noqa: E402
from planaria.observe.events import read_events  # noqa: E402
from planaria.observe.metrics import percentile, summarize  # noqa: E402

MIN_STEADY_GAPS = 5
SETTLE_S = 10.0
PG_TIMEOUT_STEPS = 10
PG_TIMEOUT_FLOOR_S = 2.0
GOODPUT_TARGET = 0.95


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="medium", choices=sorted(common.SIZES))
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--duration-s", type=float, default=600.0, help="measured window per run")
    p.add_argument("--kill-every-s", type=float, default=30.0, help="time between kills")
    p.add_argument("--seed", type=int, default=0, help="the kill schedule's seed")
    p.add_argument("--warmup", type=int, default=3, help="steps committed before the window")
    p.add_argument("--torchft-heartbeats-ms", default="250,500,1000",
                   help="lighthouse heartbeat timeouts to sweep (one run each)")
    p.add_argument("--torchft-pg-timeout-s", type=float, default=None,
                   help="torchft's gloo timeout (default: 10 x the step, at least 2 s)")
    p.add_argument("--torchrun-ckpt-every", default="5,10,20",
                   help="torchrun checkpoint intervals in steps to sweep (one run each)")
    p.add_argument("--workdir", default=None, help="where runs write (default: a temp dir)")
    p.add_argument("--from-runs", action="store_true",
                   help="run nothing: recompute the figures from the runs kept in --workdir "
                   "by an earlier run of this bench (give it the same sweep options); the "
                   "record goes to WORKDIR/goodput.json")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny model, 30 s per system, a kill every 10 s, no sweeps "
                   "(about 6 minutes with each system's start-up, measured on 2 loaded cores)")
    args = p.parse_args(argv)
    if args.from_runs and not args.workdir:
        p.error("--from-runs needs --workdir: the directory of the earlier run")
    if args.quick:
        args.size, args.duration_s, args.kill_every_s = "tiny", 30.0, 10.0
        args.torchft_heartbeats_ms, args.torchrun_ckpt_every = "500", "5"
    return args


# ---------------------------------------------------------------- figures


def _by_wall(commits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(commits, key=lambda c: c["wall"])


def _timed_gaps(commits: list[dict[str, Any]], keep: Callable[[dict, dict], bool]
                ) -> list[tuple[float, float]]:
    """(end, gap) between commits of consecutive steps (in wall order) that ``keep``
    accepts."""
    return [(b["wall"], b["wall"] - a["wall"]) for a, b in itertools.pairwise(commits)
            if b["step"] == a["step"] + 1 and keep(a, b)]


def _gaps(commits: list[dict[str, Any]], keep: Callable[[dict, dict], bool]) -> list[float]:
    """The gaps alone of :func:`_timed_gaps`."""
    return [gap for _, gap in _timed_gaps(commits, keep)]


def _kill_near(a: dict, b: dict, kills: list[float], settle_s: float = 0.0) -> bool:
    """A kill between commits a and b, or in the ``settle_s`` before a."""
    return any(a["wall"] - settle_s < k <= b["wall"] for k in kills)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _steady_gaps(window: list[dict[str, Any]], kills: list[float], replicas: int
                 ) -> list[tuple[float, float]]:
    """(end, gap) of consecutive full-width commits away from kills: none between them,
    none in the ``SETTLE_S`` before (the recovery, and the replacement or spare that
    starts then); with fewer than ``MIN_STEADY_GAPS`` of those, no kill between them."""
    for settle_s in (SETTLE_S, 0.0):
        steady = _timed_gaps(window, lambda a, b, s=settle_s: (
            a["width"] >= replicas and b["width"] >= replicas
            and not _kill_near(a, b, kills, s)))
        if len(steady) >= MIN_STEADY_GAPS:
            break
    return steady


def stretch_step_s(window: list[dict[str, Any]], kills: list[float], replicas: int
                   ) -> list[float] | None:
    """The fault-free step time of each stretch of the window between kills (one more
    than there are kills): the mean of its steady gaps, or of the whole window's where a
    stretch has fewer than ``MIN_STEADY_GAPS``; None without steady gaps.

    The mean, not the median: the time a run needs for n steps is n times the mean gap,
    and a system whose gaps are skewed (planaria's 3 workers on 2 cores: mean/median
    1.02, against 1.005 for torchft's slower steps) read ~0.98 for a run with no fault
    at all against a median. Per stretch, not one figure for the window: this machine's
    speed drifts by a few percent over ten minutes, and one baseline for the window
    charges the slow stretches' steps too little and the fast ones' too much (a run
    that sped up after its first kill read 1.005 with its first 30 s as baseline). Not
    a window sliding across kills either: its commits are denser where steps are fast,
    which weighs a fast stretch's steps with its slower neighbours' gaps (that read a
    run that sped up at a kill above 1)."""
    steady = _steady_gaps(window, kills, replicas)
    pooled = _mean([gap for _, gap in steady])
    if pooled is None:
        return None
    bounds = sorted(kills)
    stretches: list[list[float]] = [[] for _ in range(len(bounds) + 1)]
    for end, gap in steady:
        stretches[bisect.bisect_left(bounds, end)].append(gap)
    return [sum(gaps) / len(gaps) if len(gaps) >= MIN_STEADY_GAPS else pooled
            for gaps in stretches]


def step_ms_by_width(window: list[dict[str, Any]], kills: list[float]) -> dict[str, float]:
    """Mean step time at each width (consecutive commits at that width, no kill between)."""
    out: dict[str, float] = {}
    for width in sorted({c["width"] for c in window}):

        def at_width(a: dict, b: dict, w: int = width) -> bool:
            return a["width"] == w == b["width"] and not _kill_near(a, b, kills)

        gaps = _gaps(window, at_width)
        if gaps:
            out[str(width)] = round((_mean(gaps) or 0.0) * 1000, 2)
    return out


def per_kill(commits: list[dict[str, Any]], t_kill: float, replicas: int) -> dict[str, Any]:
    """recover_s, back_s (MTTR), full_width_s of one kill, from the window's commits.

    A step that was running at the kill and still committed (every all-reduce of it
    was done: the kill came after) is progress made before the fault: it counts
    in ``s_max``, and only steps begun after the kill count as recovered ones.
    """
    s_max = max((c["step"] for c in commits if c["started"] <= t_kill), default=-1)
    after = [c for c in commits if c["started"] > t_kill]
    beyond = next((c for c in after if c["step"] > s_max), None)
    full = next((c for c in after if c["width"] >= replicas), None)
    return {
        "s_max": s_max,
        "recover_s": after[0]["wall"] - t_kill if after else None,
        "back_s": beyond["wall"] - t_kill if beyond else None,
        "full_width_s": full["wall"] - t_kill if full else None,
    }


def _p(values: list[float | None], q: float) -> float | None:
    found = [v for v in values if v is not None]
    value = percentile(found, q)
    return None if value is None else round(value, 4)


def window_figures(run: dict[str, Any], replicas: int) -> dict[str, Any]:
    """The figures of the module docstring from a runner's raw records."""
    t0, t1 = run["t0"], run["t1"]
    commits = _by_wall(run["commits"])
    window = [c for c in commits if t0 < c["wall"] <= t1]
    kills = [k["t_kill"] for k in run["kills"] if t0 <= k["t_kill"] <= t1]
    high = max((c["step"] for c in commits if c["wall"] <= t0), default=-1)
    per_stretch = stretch_step_s(window, kills, replicas)
    bounds = sorted(kills)
    useful = lost = 0
    needed = 0.0  # the fault-free time of the useful steps: each at its stretch's step time
    for c in window:
        if c["step"] > high:
            useful, high = useful + 1, c["step"]
            if per_stretch:
                needed += per_stretch[bisect.bisect_left(bounds, c["wall"])]
        else:
            lost += 1
    step_s = needed / useful if useful and per_stretch else None
    span = t1 - t0
    rows = [per_kill(window, t, replicas) for t in kills]
    back = [r["back_s"] for r in rows]
    full = [r["full_width_s"] for r in rows]
    recover = [r["recover_s"] for r in rows]
    return {
        "goodput": round(needed / span, 4) if step_s else None,
        "useful_steps": useful,
        "steps_committed": len(window),
        "lost_steps": lost,
        "recoveries": sum(b is not None for b in back),
        "kills": len(kills),
        "skipped_kills": len(run.get("skipped_kills") or []),
        "mttr_s_p50": _p(back, 0.5),
        "mttr_s_p99": _p(back, 0.99),
        "full_width_s_p50": _p(full, 0.5),
        "full_width_s_p99": _p(full, 0.99),
        "recover_s_p50": _p(recover, 0.5),
        "recover_s_p99": _p(recover, 0.99),
        "step_ms": round(step_s * 1000, 2) if step_s else None,
        "step_ms_by_width": step_ms_by_width(window, kills),
        "useful_steps_per_s": round(useful / span, 3),
        "window_s": round(span, 1),
        "mttr_s": [None if b is None else round(b, 3) for b in back],
        "full_width_s": [None if f is None else round(f, 3) for f in full],
        "kill_log": [{"at_s": round(k["t_kill"] - t0, 2), "worker": k["worker"]}
                     for k in run["kills"]],
    }


def detect_from_outside(run: dict[str, Any]) -> list[float | None]:
    """Per kill: the harness's SIGKILL → planaria's ``fault`` record naming the victim."""
    faults = [e for e in run["events"] if e["event"] == "fault"]
    out: list[float | None] = []
    for kill in run["kills"]:
        seen = next((e["t"] for e in faults if e["t"] >= kill["t_kill"]
                     and kill["worker"] in str(e.get("worker", "")).split(",")), None)
        out.append(None if seen is None else seen - kill["t_kill"])
    return out


def planaria_report(run: dict[str, Any]) -> dict[str, Any]:
    """planaria's own accounting (``summarize``) over the window's records of its log, and
    its detection time measured from the harness's kills. (``summarize``'s detect_s and
    recover_s start at the fault's ``fault_t``, planaria's own estimate of when it
    happened, not at the kill.)"""
    records = [e for e in run["events"] if run["t0"] <= float(e["t"]) <= run["t1"]]
    s = summarize(records)
    recovered = [f for f in s.faults if f.recovered]
    detect = detect_from_outside(run)
    return {
        "detect_s_p50": _p(detect, 0.5),
        "detect_s_p99": _p(detect, 0.99),
        "goodput_time_based": round(s.goodput, 4),
        "badput": {k: round(v, 4) for k, v in s.badput.items() if v},
        "faults": len(s.faults),
        "faults_recovered": len(recovered),
        "own_recover_s_p50": s.recover_s.p50,
        "own_detect_s_p50": s.detect_s.p50,
        "spares_taken": sum(1 for e in records if e["event"] == "replacement_requested"
                            and e.get("spare")),
        "joins": sum(1 for e in records if e["event"] == "joined"),
    }


# ---------------------------------------------------------------- runs


def _harness(args: argparse.Namespace) -> KillHarness:
    """A fresh harness with the run's seeded schedule (the same for every system)."""
    return KillHarness(plan_kills(args.seed, args.kill_every_s, args.duration_s))


RUN_RECORD = "bench_run.json"


def _recorded(args: argparse.Namespace, wd: Path, name: str,
              start: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """A system's raw records: ``start(its dir)`` now, kept in ``wd/name/bench_run.json``
    (commits, kills, window); with ``--from-runs``, read back from there instead, so a
    change to how figures are computed can be applied to runs already made."""
    path = wd / name / RUN_RECORD
    if args.from_runs:
        if not path.exists():
            raise SystemExit(f"--from-runs {wd}: no {name}/{RUN_RECORD} there; give the "
                             "--workdir of a finished run of this bench (and its sweeps)")
        run = json.loads(path.read_text())
    else:
        run = start(wd / name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({k: v for k, v in run.items() if k != "events"},
                                   default=str))
    if "run_dir" in run and "events" not in run:  # planaria's: its event log is beside
        run["events"] = list(read_events(path.parent / "events.jsonl").events)
    return run


def run_planaria(args: argparse.Namespace, spares: int, wd: Path) -> dict[str, Any]:
    run = _recorded(args, wd, f"planaria_spares{spares}", lambda d: run_planaria_faults(
        args.duration_s, _harness(args), args.size, args.replicas, spares,
        warmup=args.warmup, run_dir=d))
    return {**window_figures(run, args.replicas), "spares": spares,
            "report": planaria_report(run), "run_dir": run["run_dir"]}


def run_torchft(args: argparse.Namespace, heartbeat_ms: int, pg_timeout_s: float, wd: Path
                ) -> dict[str, Any]:
    run = _recorded(args, wd, f"torchft_hb{heartbeat_ms}", lambda d: run_torchft_faults(
        args.duration_s, _harness(args), args.size, args.replicas,
        heartbeat_timeout_ms=heartbeat_ms, pg_timeout_s=pg_timeout_s, warmup=args.warmup,
        workdir=d))
    rejoin = [r["rejoin_s"] for r in run["replacements"]]
    return {**window_figures(run, args.replicas), "heartbeat_ms": heartbeat_ms,
            "pg_timeout_s": run["pg_timeout_s"], "async_quorum": run["async_quorum"],
            "replacements": len(run["replacements"]), "rejoin_s_p50": _p(rejoin, 0.5),
            "failed_iterations": run["failed_iterations"], "log": run["log"]}


def run_torchrun(args: argparse.Namespace, ckpt_every: int, wd: Path) -> dict[str, Any]:
    run = _recorded(args, wd, f"torchrun_ckpt{ckpt_every}", lambda d: run_torchrun_faults(
        args.duration_s, _harness(args), args.size, args.replicas, ckpt_every=ckpt_every,
        warmup=args.warmup, workdir=d))
    figures = window_figures(run, args.replicas)
    save_s = percentile([ms / 1000 for ms in run["ckpt_save_ms"]], 0.5)
    young_daly = None
    if save_s is not None and figures["step_ms"]:
        interval_s = (2 * save_s * args.kill_every_s) ** 0.5
        young_daly = round(interval_s / (figures["step_ms"] / 1000), 1)
    return {**figures, "ckpt_every": ckpt_every, "restarts": run["restarts"],
            "ckpt_save_s_p50": save_s, "young_daly_ckpt_every": young_daly, "log": run["log"]}


def best(sweep: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The sweep's run with the highest goodput (a run without a figure ranks last)."""
    return max(sweep.items(), key=lambda kv: kv[1]["goodput"] or -1.0)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _compact(figures: dict[str, Any]) -> dict[str, Any]:
    """A sweep entry without the per-kill lists."""
    return {k: v for k, v in figures.items() if not isinstance(v, list)}


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    head = (f"{'system':<28} {'goodput':>7} {'useful':>6} {'lost':>5} {'kills':>5} "
            f"{'recov':>5} {'mttr p50/p99 s':>15} {'full width p50/p99 s':>21} {'step ms':>8}")
    lines = [head]
    for name, r in rows:
        lines.append(
            f"{name:<28} {_fmt(r['goodput'], '.3f'):>7} {r['useful_steps']:>6} "
            f"{r['lost_steps']:>5} {r['kills']:>5} {r['recoveries']:>5} "
            f"{_fmt(r['mttr_s_p50']) + ' / ' + _fmt(r['mttr_s_p99']):>15} "
            f"{_fmt(r['full_width_s_p50']) + ' / ' + _fmt(r['full_width_s_p99']):>21} "
            f"{_fmt(r['step_ms'], '.1f'):>8}"
        )
    return lines


def _say(lines: list[str], text: str) -> None:
    """Prints a line of the human-readable output and keeps it for the saved table."""
    print(text, flush=True)
    lines.append(text)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_goodput_"))
    wd.mkdir(parents=True, exist_ok=True)
    load = {"before": common.loadavg()}
    t_start = time.time()
    said: list[str] = []
    plan = plan_kills(args.seed, args.kill_every_s, args.duration_s)
    _say(said, f"{args.replicas} replicas x 1 thread, size={args.size}, window "
         f"{args.duration_s:.0f} s, {len(plan)} kills (every {args.kill_every_s:.0f} s, "
         f"seed {args.seed}), {os.cpu_count()} cores")

    _say(said, "planaria, 1 spare")
    pl_spares = run_planaria(args, 1, wd)
    _say(said, "planaria, no spare")
    pl = run_planaria(args, 0, wd)
    steps = [s for s in (pl_spares["step_ms"], pl["step_ms"]) if s]
    step_s = (min(steps) / 1000) if steps else 0.1
    pg_timeout_s = args.torchft_pg_timeout_s or round(
        max(PG_TIMEOUT_FLOOR_S, PG_TIMEOUT_STEPS * step_s), 2)

    ft_sweep: dict[str, dict[str, Any]] = {}
    for hb in (int(x) for x in args.torchft_heartbeats_ms.split(",") if x):
        _say(said, f"torchft, heartbeat timeout {hb} ms, gloo timeout {pg_timeout_s} s")
        ft_sweep[str(hb)] = run_torchft(args, hb, pg_timeout_s, wd)
    tr_sweep: dict[str, dict[str, Any]] = {}
    for every in (int(x) for x in args.torchrun_ckpt_every.split(",") if x):
        _say(said, f"torchrun, checkpoint every {every} steps")
        tr_sweep[str(every)] = run_torchrun(args, every, wd)
    ft_best_key, ft = best(ft_sweep)
    tr_best_key, tr = best(tr_sweep)
    load["after"] = common.loadavg()

    _say(said, "")
    rows = [("planaria, 1 spare", pl_spares), ("planaria, no spare", pl)]
    rows += [(f"torchft, heartbeat {k} ms{' (best)' if k == ft_best_key else ''}", r)
             for k, r in ft_sweep.items()]
    rows += [(f"torchrun, ckpt every {k}{' (best)' if k == tr_best_key else ''}", r)
             for k, r in tr_sweep.items()]
    for line in table(rows):
        _say(said, line)
    for name, r in rows:
        _say(said, f"{name}: step ms by width {r['step_ms_by_width']}")
    _say(said, f"torchrun Young/Daly interval: {tr.get('young_daly_ckpt_every')} steps "
         f"(checkpoint save {_fmt(tr.get('ckpt_save_s_p50'), '.3f')} s)")
    _say(said, f"load average before {load['before']} after {load['after']}; "
         f"wall {time.time() - t_start:.0f} s")

    spares_goodput = pl_spares["goodput"]
    out = {
        "bench": "goodput",
        "planaria": pl,
        "planaria_spares": pl_spares,
        "torchft": {**ft, "sweep": {k: _compact(v) for k, v in ft_sweep.items()}},
        "torchrun": {**tr, "sweep": {k: _compact(v) for k, v in tr_sweep.items()}},
        "goodput_vs_torchft": _ratio(spares_goodput, ft["goodput"]),
        "goodput_vs_torchrun": _ratio(spares_goodput, tr["goodput"]),
        "targets": {
            "goodput_spares_min": GOODPUT_TARGET,
            "goodput_spares_met": None if spares_goodput is None
            else spares_goodput >= GOODPUT_TARGET,
            "above_peers_met": None if spares_goodput is None else all(
                p["goodput"] is None or spares_goodput > p["goodput"] for p in (ft, tr)),
        },
        "size": args.size,
        "replicas": args.replicas,
        "duration_s": args.duration_s,
        "kill_every_s": args.kill_every_s,
        "seed": args.seed,
        "planned_kills": len(plan),
        "quick": args.quick,
        "loadavg": load,
        "nproc": os.cpu_count(),
    }
    from bench import make_benchmarks_md

    command = shlex.join(["python", "bench/goodput.py", *(argv or sys.argv[1:])])
    if args.from_runs:  # the runs' own record, if this bench saved one there, keeps its load
        kept = wd / "goodput.json"
        first = json.loads(kept.read_text()) if kept.exists() else {}
        make_benchmarks_md.save(
            "goodput", out, first.get("command", command), path=kept, table=said,
            recomputed_from=str(wd),
            **{k: first[k] for k in ("loadavg_before", "loadavg_after", "wall_s") if k in first})
    elif not args.quick:
        extra = {"loadavg_before": load["before"], "loadavg_after": load["after"],
                 "wall_s": round(time.time() - t_start, 1), "table": said}
        for path in (None, wd / "goodput.json"):  # bench/results/, and beside the runs
            make_benchmarks_md.save("goodput", out, command, path=path, **extra)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
