"""Steady-state step time, planaria vs plain DDP, in one run.

    python bench/overhead.py                 # "small" model, 2 replicas, 2 rounds of 40 steps
    python bench/overhead.py --quick         # smoke run: tiny model, few steps

The same model, data, global batch (64) and micro-batch (16), 2 replicas with
1 torch thread each, two ways: planaria (``planaria.Job`` with a TrainSpec
built from ``bench.common``) and DDP under ``torchrun --nproc_per_node=2``
(``bench.baselines.runners.run_ddp_steady``). The runs are interleaved
(planaria, DDP, planaria, DDP, ...) so that both see the same machine load,
and the figures are medians over the steady steps of every round pooled
(``--warmup`` steps of each run left out).

Figures:

- ``planaria_step_ms``: the driver loop's wall time per ``Job.train_step``
  (step boundary + dispatch + waiting for every result + commit bookkeeping);
  the commit itself rides on the next dispatch, so this is the step period.
- ``ddp_step_ms``: rank 0's time per step (micro-batches, allreduce, Adam).
- ``ratio``: planaria ÷ DDP.
- ``controller_overhead_ms``: per step, planaria's wall time minus the
  slowest worker's own ``data_wait_s + compute_s + reduce_s`` (its step
  result), minus one Adam ``optimizer.step`` on the model (measured here, 1
  thread): a worker applies the committed update at the start of its next
  step call, outside its timers, and DDP's step pays for that update too.
  What is left is the price of the controller: Ray dispatch and return,
  argument and result (de)serialisation, the step boundary, the event log.
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
from bench.planaria_side import apply_ms, run_planaria_steady  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=sorted(common.SIZES))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker / rank")
    p.add_argument("--steps", type=int, default=40, help="steps per run (warm-up included)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="planaria, DDP pairs (interleaved)")
    p.add_argument("--no-tiny", action="store_true", help="skip the tiny-model cross-check")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, few steps")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.steps, args.warmup, args.rounds, args.no_tiny = "tiny", 8, 3, 1, True
    return args


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _compare(args: argparse.Namespace, size: str, rounds: int, wd: Path) -> dict[str, Any]:
    pl_ms: list[float] = []
    ddp_ms: list[float] = []
    per_round = []
    for i in range(rounds):
        pl = run_planaria_steady(
            args.steps,
            size,
            args.replicas,
            args.threads,
            warmup=args.warmup,
            run_dir=wd / f"planaria_{size}_{i}",
        )
        ddp = run_ddp_steady(
            args.steps,
            size,
            args.replicas,
            args.threads,
            warmup=args.warmup,
            timeout_s=args.timeout_s,
            workdir=wd / f"ddp_{size}_{i}",
        )
        pl_ms += pl["step_ms"]
        ddp_ms += ddp["step_ms"]
        per_round.append(
            {
                "planaria_step_ms": pl["step_ms_median"],
                "ddp_step_ms": ddp["step_ms_median"],
                "worker_ms": pl["worker_ms_median"],
                "gap_ms": pl["gap_ms_median"],
                "dispatch_gap_ms": pl["dispatch_gap_ms_median"],
            }
        )
        print(
            f"  round {i} ({size}): planaria {pl['step_ms_median']:.1f} ms "
            f"(slowest worker {pl['worker_ms_median']:.1f} ms, gap {pl['gap_ms_median']:.1f} ms), "
            f"DDP {ddp['step_ms_median']:.1f} ms; load {_loadavg()}",
            flush=True,
        )
    return {
        "planaria_step_ms": _med(pl_ms),
        "ddp_step_ms": _med(ddp_ms),
        "ratio": _med(pl_ms) / _med(ddp_ms),
        "gap_ms": _med([r["gap_ms"] for r in per_round]),
        "dispatch_gap_ms": _med([r["dispatch_gap_ms"] for r in per_round]),
        "worker_ms": _med([r["worker_ms"] for r in per_round]),
        "rounds": per_round,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_overhead_"))
    wd.mkdir(parents=True, exist_ok=True)
    load_before = _loadavg()
    t0 = time.time()
    print(
        f"overhead: size={args.size}, {args.replicas} replicas x {args.threads} thread, "
        f"{args.steps} steps ({args.warmup} warm-up), {args.rounds} interleaved rounds",
        flush=True,
    )
    main_cmp = _compare(args, args.size, args.rounds, wd)
    apply = apply_ms(args.size, threads=args.threads)
    overhead = main_cmp["gap_ms"] - apply
    tiny = None
    if not args.no_tiny and args.size != "tiny":
        tiny = _compare(args, "tiny", 1, wd)
    load_after = _loadavg()

    print()
    print(f"{'':<34} {'planaria':>9} {'DDP':>9} {'ratio':>7}")
    print(
        f"{'median step ms (' + args.size + ')':<34} {main_cmp['planaria_step_ms']:>9.1f} "
        f"{main_cmp['ddp_step_ms']:>9.1f} {main_cmp['ratio']:>7.3f}"
    )
    if tiny is not None:
        print(
            f"{'median step ms (tiny cross-check)':<34} {tiny['planaria_step_ms']:>9.1f} "
            f"{tiny['ddp_step_ms']:>9.1f} {tiny['ratio']:>7.3f}"
        )
    print(f"slowest worker's data+compute+reduce: {main_cmp['worker_ms']:.1f} ms")
    print(f"step wall minus that:                 {main_cmp['gap_ms']:.1f} ms")
    print(f"  of which Adam apply (measured):      {apply:.1f} ms")
    print(f"  controller overhead:                 {overhead:.1f} ms per step")
    print(f"load average before {load_before} after {load_after}; wall {time.time() - t0:.0f} s")

    out = {
        "bench": "overhead",
        "planaria_step_ms": main_cmp["planaria_step_ms"],
        "ddp_step_ms": main_cmp["ddp_step_ms"],
        "ratio": main_cmp["ratio"],
        "controller_overhead_ms": overhead,
        "worker_step_ms": main_cmp["worker_ms"],
        "gap_ms": main_cmp["gap_ms"],
        "apply_ms": apply,
        "tiny": None
        if tiny is None
        else {k: tiny[k] for k in ("planaria_step_ms", "ddp_step_ms", "ratio", "gap_ms")},
        "rounds": main_cmp["rounds"],
        "size": args.size,
        "replicas": args.replicas,
        "threads": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "loadavg": {"before": load_before, "after": load_after},
        "nproc": os.cpu_count(),
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
