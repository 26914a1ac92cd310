"""torchft at its best: a coordinate-descent sweep of its knobs under repeated kills.

    python bench/torchft_sweep.py --out bench/results/torchft_best.json   # the real sweep
    python bench/torchft_sweep.py --quick        # smoke: two configs, 20 s windows, temp dir

Each configuration (``bench/baselines/torchft_config.TorchftConfig``) trains the
``--size`` model on ``--groups`` torchft replica groups for a window of
``--window-s`` while the kill harness SIGKILLs a group every ``--kill-every-s``
(``bench/kill_harness.plan_kills`` with ``--seed``: the same schedule for every
configuration; ``torchft_runners.run_torchft_faults``). The score is goodput as
``bench/goodput.py`` computes it (its ``window_figures``), the median over
``--repeats`` runs of the same schedule.

The knobs are swept one at a time from the best so far (coordinate descent), in
this order, keeping the budget bounded:

1. the lighthouse's heartbeat timeout, ``--heartbeats-ms`` from the largest
   down, stopping at the first value that does not improve on the best;
2. the lighthouse's quorum tick, ``--ticks-ms``;
3. the gloo timeout, ``--pg-timeouts-s`` (a run also counts the iterations whose
   allreduce lasted at least 90 % of it: a recovery that hit the timeout);
4. asynchronous quorum on / off;
5. a warm standby replacement on / off.

A configuration already run is not run again. The budget (runs x (window +
start-up)) is printed before the first run. Only with ``--out`` is the result
written there (``{"config": best, "torchft_version", "commit", "command",
"table": [every run configuration's score and figures], ...}``, what
``torchft_config.load_best`` reads); otherwise it goes to the work directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from bench.baselines.torchft_config import TorchftConfig  # noqa: E402
from bench.baselines.torchft_runners import run_torchft_faults, torchft_version  # noqa: E402
from bench.goodput import window_figures  # noqa: E402
from bench.kill_harness import KillHarness, plan_kills  # noqa: E402

START_UP_S = 25.0
"""Start-up and teardown of one run beside its window (lighthouse, groups, warm-up), for
the budget: measured ~15-25 s on the 2-core machine."""

Score = Callable[[TorchftConfig], float | None]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window-s", type=float, default=90.0)
    p.add_argument("--kill-every-s", type=float, default=15.0)
    p.add_argument("--size", default="medium")
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration (median)")
    p.add_argument("--heartbeats-ms", default="1000,500,250,100,50")
    p.add_argument("--ticks-ms", default="100,50,20,10")
    p.add_argument("--pg-timeouts-s", default="0.5,1,2,5")
    p.add_argument("--start", default="{}",
                   help='the first configuration, JSON of TorchftConfig fields '
                   '(default: heartbeat 1000 ms, tick 100 ms, gloo 2 s, async, cold)')
    p.add_argument("--out", default=None, help="write the result here (the real sweep)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--quick", action="store_true",
                   help="smoke: the start and the start with a warm standby, 20 s windows")
    args = p.parse_args(argv)
    if args.quick:
        args.window_s, args.kill_every_s = 20.0, 6.0
    return args


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def knob_steps(args: argparse.Namespace) -> list[tuple[str, list[Any]]]:
    """The knobs in sweep order, each with its candidate values."""
    if args.quick:
        return [("warm_standby", [False, True])]
    return [("heartbeat_ms", sorted(_ints(args.heartbeats_ms), reverse=True)),
            ("quorum_tick_ms", _ints(args.ticks_ms)),
            ("pg_timeout_s", _floats(args.pg_timeouts_s)),
            ("async_quorum", [True, False]),
            ("warm_standby", [False, True])]


def most_runs(start: TorchftConfig, steps: list[tuple[str, list[Any]]]) -> int:
    """The most configurations coordinate descent can run (each knob's values, less the
    one the start already has)."""
    return 1 + sum(len([v for v in values if v != getattr(start, knob)]) for knob, values in steps)


def descend(start: TorchftConfig, steps: list[tuple[str, list[Any]]], score: Score
            ) -> tuple[TorchftConfig, dict[TorchftConfig, float | None]]:
    """Coordinate descent: per knob, its values tried from the best so far; the heartbeat
    (values from the largest) stops at the first that does not improve. A config's score
    is asked once; None (a run that failed) never wins. Returns the best and every score."""
    scores: dict[TorchftConfig, float | None] = {}

    def scored(c: TorchftConfig) -> float:
        if c not in scores:
            scores[c] = score(c)
        s = scores[c]
        return float("-inf") if s is None else s

    best = start
    for knob, values in steps:
        for value in values:
            candidate = dataclasses.replace(best, **{knob: value})
            if scored(candidate) > scored(best):
                best = candidate
            elif knob == "heartbeat_ms" and value < best.heartbeat_ms:
                break  # lower heartbeats stopped improving
    return best, scores


def timeout_hits(log: Path, pg_timeout_s: float) -> int:
    """Iterations whose allreduce lasted >= 90 % of the gloo timeout (one that hit it)."""
    hits = 0
    if not log.exists():
        return 0
    for line in log.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        phases = r.get("phases_ms") or {}
        if phases.get("allreduce", 0.0) >= 0.9 * pg_timeout_s * 1000:
            hits += 1
    return hits


def run_one(args: argparse.Namespace, config: TorchftConfig, wd: Path) -> dict[str, Any]:
    """One window of ``config``: its goodput figures and what the sweep reports beside."""
    run = run_torchft_faults(
        args.window_s, KillHarness(plan_kills(args.seed, args.kill_every_s, args.window_s)),
        args.size, args.groups, config=config, threads=args.threads, warmup=args.warmup,
        workdir=wd)
    figures = window_figures(run, args.groups)
    rejoin = [r["rejoin_s"] for r in run["replacements"] if r["rejoin_s"] is not None]
    return {"goodput": figures["goodput"], "mttr_s_p50": figures["mttr_s_p50"],
            "lost_steps": figures["lost_steps"], "kills": figures["kills"],
            "skipped_kills": figures["skipped_kills"], "step_ms": figures["step_ms"],
            "failed_iterations": run["failed_iterations"],
            "pg_timeout_hits": timeout_hits(Path(run["log"]), float(config.pg_timeout_s or 0)),
            "rejoin_s_p50": statistics.median(rejoin) if rejoin else None}


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = TorchftConfig(**{"heartbeat_ms": 1000, "quorum_tick_ms": 100, "pg_timeout_s": 2.0,
                             "async_quorum": True, "warm_standby": False,
                             **json.loads(args.start)})
    steps = knob_steps(args)
    runs = most_runs(start, steps) * args.repeats
    print(f"budget: at most {runs} runs x ({args.window_s:g} s window + ~{START_UP_S:g} s "
          f"start-up) = ~{runs * (args.window_s + START_UP_S) / 60:.0f} min; "
          f"{args.groups} groups of the {args.size} model, a kill every "
          f"{args.kill_every_s:g} s (seed {args.seed}); load {_load()}", flush=True)
    wd = Path(args.workdir or tempfile.mkdtemp(prefix="torchft_sweep_"))
    table: list[dict[str, Any]] = []
    load_before = _load()

    def score(config: TorchftConfig) -> float | None:
        reps = []
        for r in range(args.repeats):
            try:
                rep = run_one(args, config, wd / f"run{len(table)}_{r}")
            except (RuntimeError, TimeoutError) as err:  # a configuration that breaks torchft
                rep = {"goodput": None, "error": str(err)[:500]}
            reps.append(rep)
        goodputs = [r["goodput"] for r in reps if r["goodput"] is not None]
        row = {"label": config.label(), "config": config.as_dict(),
               "goodput": statistics.median(goodputs) if goodputs else None, "runs": reps}
        table.append(row)
        print(json.dumps({k: row[k] for k in ("label", "goodput")} | {
            "rejoin_s_p50": reps[0].get("rejoin_s_p50"),
            "pg_timeout_hits": reps[0].get("pg_timeout_hits")}), flush=True)
        return row["goodput"]

    best, _ = descend(start, steps, score)
    result = {"bench": "torchft_sweep", "config": best.as_dict(), "label": best.label(),
              "torchft_version": torchft_version(), "commit": _commit(),
              "command": shlex.join([sys.executable, *sys.argv]),
              "score": "goodput (bench/goodput.py window_figures), median over repeats",
              "window_s": args.window_s, "kill_every_s": args.kill_every_s, "seed": args.seed,
              "size": args.size, "groups": args.groups, "repeats": args.repeats,
              "load_before": load_before, "load_after": _load(), "table": table}
    out = Path(args.out) if args.out else wd / "torchft_best.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {out}", flush=True)
    print(json.dumps({k: result[k] for k in ("bench", "config", "torchft_version", "commit")}))
    return result


if __name__ == "__main__":
    main()
