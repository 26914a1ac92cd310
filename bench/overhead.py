"""Steady-state step time, planaria vs plain DDP, in one run.

    python bench/overhead.py                 # "small" model, 2 replicas, 3 rounds of 60
    python bench/overhead.py --quick         # smoke run: tiny model, few steps

The same model, data, global batch (64) and micro-batch (16), 2 replicas with
1 torch thread each, three ways: planaria (``planaria.Job`` with a TrainSpec
built from ``bench.common``) under each step protocol, and DDP under ``torchrun
--nproc_per_node=2`` (``bench.baselines.runners.run_ddp_steady``). The runs are
interleaved (planaria, planaria per step, DDP, ...) so that all see the same load,
and the figures are medians over the steady steps of every round pooled
(``--warmup`` steps of each run left out).

Figures:

- ``planaria_step_ms``: the step period under the autonomous loop (``fit``'s:
  ``Job.run_steps``, see ``planaria.run_ahead``): the time between two of rank
  0's commits, in one run of the steady steps.
- ``per_step_protocol_step_ms`` (and its ratio): under the per-step protocol,
  the driver loop's wall time per ``Job.train_step`` (step boundary + dispatch
  + waiting for every result + commit bookkeeping); the commit itself rides on
  the next dispatch, so this is the step period. The breakdown below is this
  protocol's.
- ``ddp_step_ms``: rank 0's time per step (micro-batches, allreduce, Adam).
- ``ratio``: planaria ÷ DDP.
- ``controller_overhead_ms``: per step, planaria's wall time minus the
  slowest worker's own ``data_wait_s + compute_s + reduce_s`` (from its step
  result) minus its update apply. A worker applies the committed update
  (Adam) at the start of its next step call, outside its timers, and DDP's
  step pays for that update too, so it is work, not overhead; the bench's
  worker subclass (``bench.planaria_side.TimedWorker``: two ``perf_counter``
  calls) reports it. What is left is the price of the controller: Ray
  dispatch and return, (de)serialisation, the step boundary, the event log.
  ``breakdown_ms`` splits the step further (see ``run_planaria_steady``).
- a ``tiny``-model cross-check (``--no-tiny`` to skip): the same comparison
  with a model whose compute is a few ms, so that the difference of the two
  step times is the fixed per-step cost.

The last line printed is one JSON object (``"bench": "overhead"``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from bench import common  # noqa: E402
from bench.baselines.runners import run_ddp_steady  # noqa: E402
from bench.planaria_side import run_planaria_steady  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=sorted(common.SIZES))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker / rank")
    p.add_argument("--steps", type=int, default=60, help="steps per run (warm-up included)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--tiny-steps", type=int, default=300,
                   help="steps per run of the tiny-model cross-check (its steps take ms)")
    p.add_argument("--tiny-warmup", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="planaria, DDP pairs (interleaved)")
    p.add_argument("--no-tiny", action="store_true", help="skip the tiny-model cross-check")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, few steps")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.steps, args.warmup, args.rounds, args.no_tiny = "tiny", 8, 3, 1, True
    return args


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


BREAKDOWN = (
    "worker_ms",
    "apply_ms",
    "worker_other_ms",
    "transport_ms",
    "bookkeeping_ms",
    "gap_ms",
    "controller_ms",
)


def _compare(args: argparse.Namespace, size: str, rounds: int, wd: Path, *, steps: int,
             warmup: int) -> dict[str, Any]:
    pl_ms: list[float] = []
    ps_ms: list[float] = []
    ddp_ms: list[float] = []
    per_round = []
    for i in range(rounds):
        # Both step protocols, side by side (the per-step one gives the step's breakdown).
        runs = {
            protocol: run_planaria_steady(
                steps, size, args.replicas, args.threads, warmup=warmup,
                run_dir=wd / f"planaria_{protocol}_{size}_{i}", step_protocol=protocol,
            )
            for protocol in ("autonomous", "per_step")
        }
        auto, pl = runs["autonomous"], runs["per_step"]
        ddp = run_ddp_steady(
            steps,
            size,
            args.replicas,
            args.threads,
            warmup=warmup,
            timeout_s=args.timeout_s,
            workdir=wd / f"ddp_{size}_{i}",
        )
        pl_ms += auto["step_ms"]
        ps_ms += pl["step_ms"]
        ddp_ms += ddp["step_ms"]
        row = {"planaria_step_ms": auto["step_ms_median"], "ddp_step_ms": ddp["step_ms_median"],
               "per_step_protocol_step_ms": pl["step_ms_median"]}
        row["ratio"] = row["planaria_step_ms"] / row["ddp_step_ms"]
        row["per_step_protocol_ratio"] = row["per_step_protocol_step_ms"] / row["ddp_step_ms"]
        row.update({k: pl[f"{k}_median"] for k in BREAKDOWN})
        per_round.append(row)
        print(
            f"  round {i} ({size}): planaria {row['planaria_step_ms']:.2f} ms (autonomous "
            f"loop), {row['per_step_protocol_step_ms']:.2f} ms per step (slowest worker "
            f"{row['worker_ms']:.1f} + apply {row['apply_ms']:.1f} ms, controller "
            f"{row['controller_ms']:.1f} ms), DDP {row['ddp_step_ms']:.2f} ms, ratio "
            f"{row['ratio']:.3f} (per step {row['per_step_protocol_ratio']:.3f}); "
            f"load {common.loadavg()}",
            flush=True,
        )
    out = {
        "planaria_step_ms": _med(pl_ms),
        "ddp_step_ms": _med(ddp_ms),
        "ratio": _med(pl_ms) / _med(ddp_ms),
        "per_step_protocol_step_ms": _med(ps_ms),
        "per_step_protocol_ratio": _med(ps_ms) / _med(ddp_ms),
        "ratio_per_round_median": _med([r["ratio"] for r in per_round]),
        "rounds": per_round,
    }
    out.update({k: _med([r[k] for r in per_round]) for k in BREAKDOWN})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_overhead_"))
    wd.mkdir(parents=True, exist_ok=True)
    load_before = common.loadavg()
    t0 = time.time()
    print(
        f"overhead: size={args.size}, {args.replicas} replicas x {args.threads} thread, "
        f"{args.steps} steps ({args.warmup} warm-up), {args.rounds} interleaved rounds",
        flush=True,
    )
    main_cmp = _compare(args, args.size, args.rounds, wd, steps=args.steps, warmup=args.warmup)
    tiny = None
    if not args.no_tiny and args.size != "tiny":
        tiny = _compare(args, "tiny", args.rounds, wd, steps=args.tiny_steps,
                        warmup=args.tiny_warmup)
    load_after = common.loadavg()

    m = main_cmp
    print()
    print(f"{'':<36} {'planaria':>9} {'DDP':>9} {'ratio':>7}")
    print(
        f"{'median step ms (' + args.size + ')':<36} {m['planaria_step_ms']:>9.1f} "
        f"{m['ddp_step_ms']:>9.1f} {m['ratio']:>7.3f}"
    )
    if tiny is not None:
        print(
            f"{'median step ms (tiny cross-check)':<36} {tiny['planaria_step_ms']:>9.1f} "
            f"{tiny['ddp_step_ms']:>9.1f} {tiny['ratio']:>7.3f}"
        )
    print(f"ratio, median of the per-round ratios: {m['ratio_per_round_median']:.3f}")
    print(f"per-step protocol (Job.train_step): {m['per_step_protocol_step_ms']:.1f} ms, ratio "
          f"{m['per_step_protocol_ratio']:.3f}")
    print("the per-step protocol's step, per-step medians (median over rounds), ms:")
    print(f"  slowest worker data wait + compute + reduce  {m['worker_ms']:7.1f}")
    print(f"  its update apply (Adam, outside its timers)  {m['apply_ms']:7.1f}")
    print(f"  rest of its step call                        {m['worker_other_ms']:7.1f}")
    print(f"  Ray transport (dispatch -> results back)     {m['transport_ms']:7.1f}")
    print(f"  controller bookkeeping (boundary, log)       {m['bookkeeping_ms']:7.1f}")
    print(f"  step wall - data/compute/reduce ('gap')      {m['gap_ms']:7.1f}")
    print(f"  controller overhead (gap - apply)            {m['controller_ms']:7.1f}")
    print(f"load average before {load_before} after {load_after}; wall {time.time() - t0:.0f} s")

    out = {
        "bench": "overhead",
        "planaria_step_ms": m["planaria_step_ms"],
        "ddp_step_ms": m["ddp_step_ms"],
        "ratio": m["ratio"],
        "controller_overhead_ms": m["controller_ms"],
        "per_step_protocol_step_ms": m["per_step_protocol_step_ms"],
        "per_step_protocol_ratio": m["per_step_protocol_ratio"],
        "ratio_per_round_median": m["ratio_per_round_median"],
        "breakdown_ms": {k: m[k] for k in BREAKDOWN},
        "tiny": None
        if tiny is None
        else {k: tiny[k] for k in ("planaria_step_ms", "ddp_step_ms", "ratio", "controller_ms",
                                   "per_step_protocol_step_ms", "per_step_protocol_ratio",
                                   "rounds")},
        "rounds": m["rounds"],
        "size": args.size,
        "replicas": args.replicas,
        "threads": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "tiny_steps": None if tiny is None else args.tiny_steps,
        "tiny_warmup": None if tiny is None else args.tiny_warmup,
        "loadavg": {"before": load_before, "after": load_after},
        "nproc": os.cpu_count(),
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
