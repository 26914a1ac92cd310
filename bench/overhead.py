"""Steady-state step time, planaria vs plain DDP, in one run.

    python bench/overhead.py                 # "small" model, 2 replicas, 10 rounds of 60
    python bench/overhead.py --quick         # smoke run: tiny model, few steps

The same model, data, global batch (64) and micro-batch (16), 2 replicas with
1 torch thread each, three ways: planaria (``planaria.Job`` with a TrainSpec
built from ``bench.common``) driven as ``fit`` drives it and one step at a time, and
DDP under ``torchrun --nproc_per_node=2`` (``bench.baselines.runners.run_ddp_steady``).
The runs are interleaved (planaria, DDP, planaria, ...; one step at a time too in the
first ``--train-step-rounds``) so that all see the same load, and the figures are
medians over the steady steps of every round pooled (``--warmup`` steps of each
run left out), with 95% intervals bootstrapped over the rounds. Neither side
prefetches in a background thread on this machine (planaria's ``prefetch`` is off
where no core is spare); a planaria worker loads the next
step's share on its own thread while the all-reduce is in flight (see
bench/README.md), and DDP does the same (``ddp_train.py --prefetch ahead``: a comm
hook loads the next step while the step's last bucket is reduced); where a core is
spare, both load the next step on a background thread (``--prefetch thread``).

Figures:

- ``planaria_step_ms``: the step period in runs up to the next boundary (``fit``'s:
  ``Job.run_steps``, see ``planaria.control.run_ahead``): the time between two of rank
  0's commits, in one run of the steady steps.
- ``train_step_ms`` (and its ratio): one step's latency, the driver loop's wall
  time per ``Job.train_step`` (a run of one step: step boundary + the run's calls +
  waiting for every result + commit bookkeeping). The breakdown below is that step's.
- ``ddp_step_ms``: rank 0's time per step (micro-batches, allreduce, Adam).
- ``*_mean``: the same step times' means (``ratio_of_means``); the medians are the
  estimator the claims rest on, chosen before the runs.
- ``ratio``: planaria ÷ DDP, with ``ratio_ci95``; ``fixed_ms``: planaria minus DDP,
  the fixed cost a step, with ``fixed_ms_ci95``.
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
    p.add_argument("--rounds", type=int, default=10, help="planaria, DDP pairs (interleaved)")
    p.add_argument("--train-step-rounds", type=int, default=2,
                   help="of those, how many also run one step at a time (its breakdown)")
    p.add_argument("--no-tiny", action="store_true", help="skip the tiny-model cross-check")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, few steps")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.steps, args.warmup, args.rounds, args.no_tiny = "tiny", 8, 3, 2, True
    return args


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs)


def ddp_prefetch(replicas: int, threads: int) -> str:
    """DDP's loading, the same as planaria's worker chooses
    (``SampleLoader.want_prefetch``): a loader thread where the node has a core to spare,
    else the next step's load while the step's last reduction is in flight
    (bench/baselines/ddp_train.py)."""
    return "thread" if (os.cpu_count() or 1) > replicas * threads else "ahead"


BREAKDOWN = (
    "worker_ms",
    "apply_ms",
    "worker_other_ms",
    "transport_ms",
    "bookkeeping_ms",
    "gap_ms",
    "controller_ms",
)


def _interval(pl: list[list[float]], ddp: list[list[float]]) -> dict[str, list[float]]:
    """95% intervals of the pooled-median ratio and difference, bootstrapped over rounds
    (a round's planaria and DDP runs resampled together: they shared the machine's load)."""
    import numpy as np

    rng = np.random.default_rng(0)
    ratios, diffs = [], []
    for _ in range(2000):
        pick = rng.integers(0, len(pl), len(pl))
        a = _med([x for i in pick for x in pl[i]])
        b = _med([x for i in pick for x in ddp[i]])
        ratios.append(a / b)
        diffs.append(a - b)
    lo_hi = (2.5, 97.5)
    return {"ratio_ci95": [float(v) for v in np.percentile(ratios, lo_hi)],
            "fixed_ms_ci95": [float(v) for v in np.percentile(diffs, lo_hi)]}


def _compare(args: argparse.Namespace, size: str, rounds: int, wd: Path, *, steps: int,
             warmup: int) -> dict[str, Any]:
    pl_rounds: list[list[float]] = []
    ddp_rounds: list[list[float]] = []
    ps_ms: list[float] = []
    per_round = []
    for i in range(rounds):
        auto = run_planaria_steady(steps, size, args.replicas, args.threads, warmup=warmup,
                                   run_dir=wd / f"planaria_run_steps_{size}_{i}",
                                   driver="run_steps")
        # One step at a time, side by side in the first rounds (a step's breakdown).
        pl = None
        if i < args.train_step_rounds:
            pl = run_planaria_steady(steps, size, args.replicas, args.threads, warmup=warmup,
                                     run_dir=wd / f"planaria_train_step_{size}_{i}",
                                     driver="train_step")
            ps_ms += pl["step_ms"]
        ddp = run_ddp_steady(
            steps,
            size,
            args.replicas,
            args.threads,
            warmup=warmup,
            timeout_s=args.timeout_s,
            workdir=wd / f"ddp_{size}_{i}",
            prefetch=ddp_prefetch(args.replicas, args.threads),
        )
        pl_rounds.append(auto["step_ms"])
        ddp_rounds.append(ddp["step_ms"])
        row: dict[str, Any] = {"planaria_step_ms": auto["step_ms_median"],
                               "ddp_step_ms": ddp["step_ms_median"]}
        row["ratio"] = row["planaria_step_ms"] / row["ddp_step_ms"]
        text = ""
        if pl is not None:
            row["train_step_ms"] = pl["step_ms_median"]
            row["train_step_ratio"] = pl["step_ms_median"] / row["ddp_step_ms"]
            row.update({k: pl[f"{k}_median"] for k in BREAKDOWN})
            text = (f", {row['train_step_ms']:.2f} ms a train_step (slowest worker "
                    f"{row['worker_ms']:.1f} + apply {row['apply_ms']:.1f} ms, controller "
                    f"{row['controller_ms']:.1f} ms)")
        per_round.append(row)
        print(
            f"  round {i} ({size}): planaria {row['planaria_step_ms']:.2f} ms (fit's runs)"
            f"{text}, DDP {row['ddp_step_ms']:.2f} ms, ratio {row['ratio']:.3f}; "
            f"load {common.loadavg()}",
            flush=True,
        )
    pl_ms = [x for r in pl_rounds for x in r]
    ddp_ms = [x for r in ddp_rounds for x in r]
    with_ps = [r for r in per_round if "train_step_ms" in r]
    out = {
        "planaria_step_ms": _med(pl_ms),
        "ddp_step_ms": _med(ddp_ms),
        "ratio": _med(pl_ms) / _med(ddp_ms),
        "planaria_step_ms_mean": _mean(pl_ms),
        "ddp_step_ms_mean": _mean(ddp_ms),
        "ratio_of_means": _mean(pl_ms) / _mean(ddp_ms),
        "train_step_ms_mean": _mean(ps_ms) if ps_ms else None,
        "fixed_ms": _med(pl_ms) - _med(ddp_ms),
        **_interval(pl_rounds, ddp_rounds),
        "train_step_ms": _med(ps_ms) if ps_ms else None,
        "train_step_ratio": _med(ps_ms) / _med(ddp_ms) if ps_ms else None,
        "ratio_per_round_median": _med([r["ratio"] for r in per_round]),
        "rounds": per_round,
    }
    out.update({k: _med([r[k] for r in with_ps]) if with_ps else None for k in BREAKDOWN})
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
    for name, c in (("", m), ("tiny ", tiny)):
        if c is not None:
            lo, hi = c["ratio_ci95"]
            flo, fhi = c["fixed_ms_ci95"]
            print(f"{name}ratio {c['ratio']:.3f} (95% interval {lo:.3f}-{hi:.3f} over "
                  f"{args.rounds} rounds); fixed cost {c['fixed_ms']:+.2f} ms a step "
                  f"({flo:+.2f} to {fhi:+.2f})")
    for name, c in (("", m), ("tiny ", tiny)):
        if c is not None:
            print(f"{name}mean step ms: planaria {c['planaria_step_ms_mean']:.2f}, DDP "
                  f"{c['ddp_step_ms_mean']:.2f}, ratio of means {c['ratio_of_means']:.3f}")
    print(f"ratio, median of the per-round ratios: {m['ratio_per_round_median']:.3f}")
    if m["train_step_ms"] is not None:
        _print_breakdown(m, args.train_step_rounds)
    print(f"load average before {load_before} after {load_after}; wall {time.time() - t0:.0f} s")

    out = {
        "bench": "overhead",
        "planaria_step_ms": m["planaria_step_ms"],
        "ddp_step_ms": m["ddp_step_ms"],
        "ratio": m["ratio"],
        "ratio_ci95": m["ratio_ci95"],
        "fixed_ms": m["fixed_ms"],
        "fixed_ms_ci95": m["fixed_ms_ci95"],
        "controller_overhead_ms": m["controller_ms"],
        "train_step_ms": m["train_step_ms"],
        "train_step_ratio": m["train_step_ratio"],
        "ratio_per_round_median": m["ratio_per_round_median"],
        "planaria_step_ms_mean": m["planaria_step_ms_mean"],
        "ddp_step_ms_mean": m["ddp_step_ms_mean"],
        "ratio_of_means": m["ratio_of_means"],
        "train_step_ms_mean": m["train_step_ms_mean"],
        "ddp_prefetch": ddp_prefetch(args.replicas, args.threads),
        "breakdown_ms": {k: m[k] for k in BREAKDOWN},
        "tiny": None
        if tiny is None
        else {k: tiny[k] for k in ("planaria_step_ms", "ddp_step_ms", "ratio", "ratio_ci95",
                                   "fixed_ms", "fixed_ms_ci95", "controller_ms",
                                   "train_step_ms", "train_step_ratio",
                                   "planaria_step_ms_mean", "ddp_step_ms_mean",
                                   "ratio_of_means", "train_step_ms_mean",
                                   "rounds")},
        "rounds": m["rounds"],
        "train_step_rounds": args.train_step_rounds,
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


def _print_breakdown(m: dict[str, Any], rounds: int) -> None:
    print(f"one step at a time (Job.train_step, a run of one): {m['train_step_ms']:.1f} ms, "
          f"ratio {m['train_step_ratio']:.3f}")
    print(f"its step, per-step medians (median over its {rounds} rounds), ms:")
    print(f"  slowest worker data wait + compute + reduce  {m['worker_ms']:7.1f}")
    print(f"  its update apply (Adam, outside its timers)  {m['apply_ms']:7.1f}")
    print(f"  rest of its run call                         {m['worker_other_ms']:7.1f}")
    print(f"  Ray transport (dispatch -> results back)     {m['transport_ms']:7.1f}")
    print(f"  controller bookkeeping (boundary, log)       {m['bookkeeping_ms']:7.1f}")
    print(f"  step wall - data/compute/reduce ('gap')      {m['gap_ms']:7.1f}")
    print(f"  controller overhead (gap - apply)            {m['controller_ms']:7.1f}")


if __name__ == "__main__":
    main()
