"""Steady-state step time, planaria vs plain DDP, in one run.

    python bench/overhead.py                 # "small" model, 2 replicas, 10 rounds of 60
    python bench/overhead.py --quick         # smoke run: tiny model, few steps

The same model, data, global batch (48) and micro-batch (8), 2 replicas with
1 torch thread each: planaria (``planaria.Job`` with a TrainSpec built from
``bench.common``) driven as ``fit`` drives it (and one step at a time in the first
``--train-step-rounds``), and DDP under ``torchrun --nproc_per_node=2``
(``bench.baselines.runners.run_ddp_steady``), as two pairs that load the samples alike:

- ``like_for_like`` (the headline): each side loads the next step as planaria does.
  Where no core is spare (2 replicas on 2 cores here) a planaria worker loads its share of
  the next step on its own thread while the gradient's all-reduce is in flight, and DDP
  does the same (``ddp_train.py --prefetch ahead``: a comm hook runs the next step's load
  while the step's last bucket is reduced); where a core is spare, both load on a
  background thread (``--prefetch thread``, planaria's ``prefetch``).
- ``inline``: neither side loads ahead: each loads a step's samples when the step starts
  (planaria's worker with its load-ahead off, :class:`InlineLoadWorker`, and
  ``prefetch=False``; DDP ``--prefetch none``).

A round runs each pair's planaria and DDP runs back to back (the pairs' order alternating
from round to round) so that the two runs of a pair see the same load.

The estimator, chosen before the runs (for each pair and model): a run's figure is the
median of its steady step times (``--warmup`` steps left out); a round's ratio is its
planaria run's figure over its DDP run's; ``ratio`` is the median over the rounds of
those paired ratios, with a 95% percentile bootstrap interval (``ratio_ci95``: the
rounds resampled, 4000 draws, seed 0). ``fixed_ms`` (planaria minus DDP, a step) is
estimated the same way from the paired differences. ``planaria_step_ms`` and
``ddp_step_ms`` are the medians over the rounds of the runs' figures (descriptive).
The means (``*_mean``, ``ratio_of_means``: the means of the runs' mean step times) are
reported beside, descriptive only: no claim rests on them. The target (issue 31):
``ratio`` <= 1.03 with ``ratio_ci95``'s upper end <= 1.05, ``small`` model, idle machine.

Figures:

- ``planaria_step_ms``: the step period in runs up to the next boundary (``fit``'s:
  ``Job.run_steps``, see ``planaria.control.run_ahead``): the time between two of rank
  0's commits, in one run of the steady steps.
- ``train_step_ms`` (and its ratio): one step's latency, the driver loop's wall
  time per ``Job.train_step`` (a run of one step: step boundary + the run's calls +
  waiting for every result + commit bookkeeping). The breakdown below is that step's.
- ``ddp_step_ms``: rank 0's step period, as planaria's: the time between two steps' ends
  (micro-batches, allreduce, Adam, and the loop's work between steps: its log line).
- ``controller_overhead_ms``: per step, planaria's wall time minus the
  slowest worker's own ``data_wait_s + compute_s + reduce_s`` (from its step
  result) minus its update apply. A worker applies the committed update
  (Adam) at the start of its next step call, outside its timers, and DDP's
  step pays for that update too, so it is work, not overhead; the bench's
  worker subclass (``bench.planaria_side.TimedWorker``: two ``perf_counter``
  calls) reports it. What is left is the price of the controller: Ray
  dispatch and return, (de)serialisation, the step boundary, the event log.
  ``breakdown_ms`` splits the step further (see ``run_planaria_steady``).
- ``inline``: the same figures for the ``inline`` pair.
- a ``tiny``-model cross-check (``--no-tiny`` to skip; the like-for-like pair): the same
  comparison with a model whose compute is a few ms, so that the difference of the two
  step times is the fixed per-step cost.

Every run's record (its step times, the load before and after) is appended to
``runs.jsonl`` under ``--raw-dir`` (default ``bench/results/raw/overhead/<commit>/``; a
``--quick`` run's goes to its work directory), beside ``summary.json``. The last line
printed is one JSON object (``"bench": "overhead"``, with ``commit``, ``command`` and
``loadavg`` before and after).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from bench import common  # noqa: E402
from bench.baselines.runners import run_ddp_steady  # noqa: E402
from bench.planaria_side import run_planaria_steady  # noqa: E402
from bench.stats import bootstrap  # noqa: E402
from planaria.worker import Worker  # noqa: E402

PAIRS = ("like_for_like", "inline")
"""The pairs of runs (module doc): both sides load as planaria does, or neither ahead."""


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
    p.add_argument("--rounds", type=int, default=10,
                   help="rounds: each runs every pair's planaria and DDP runs")
    p.add_argument("--train-step-rounds", type=int, default=2,
                   help="of those, how many also run one step at a time (its breakdown)")
    p.add_argument("--pairs", default=",".join(PAIRS),
                   help=f"comma-separated pairs to run, of {', '.join(PAIRS)}")
    p.add_argument("--no-tiny", action="store_true", help="skip the tiny-model cross-check")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--raw-dir", default=None,
                   help="where runs.jsonl and summary.json go (default: "
                        "bench/results/raw/overhead/<commit>/; --quick: the work directory)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, few steps")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.steps, args.warmup, args.rounds, args.no_tiny = "tiny", 8, 3, 2, True
        args.train_step_rounds = min(args.train_step_rounds, 1)
    args.pairs = [x for x in args.pairs.split(",") if x]
    if not args.pairs or set(args.pairs) - set(PAIRS):
        p.error(f"--pairs: choose from {', '.join(PAIRS)}")
    return args


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs)


def bootstrap_ci95(values: Sequence[float], stat: Callable[[list[float]], float] = _med
                   ) -> list[float]:
    """95% percentile bootstrap interval of ``stat`` over ``values`` (resampled whole):
    :func:`bench.stats.bootstrap`, the benches' one bootstrap."""
    lo, hi = bootstrap(len(values), lambda idx: stat([values[i] for i in idx]))
    return [lo, hi]


def ddp_prefetch(replicas: int, threads: int) -> str:
    """DDP's loading, the same as planaria's worker chooses
    (``SampleLoader.want_prefetch``): a loader thread where the node has a core to spare,
    else the next step's load while the step's last reduction is in flight
    (bench/baselines/ddp_train.py)."""
    return "thread" if (os.cpu_count() or 1) > replicas * threads else "ahead"


class InlineLoadWorker(Worker):
    """planaria's worker with its load-ahead off (module level: Ray imports it by name): the
    next step's share is planned as nothing, so no load runs during the all-reduce, and each
    step loads its share when it starts. With ``RunConfig.prefetch=False`` (no loader
    thread), the ``inline`` pair's planaria side."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        plan_ahead = self.loader.plan_ahead

        def plan_nothing(ids: Any, step: int, first: int) -> None:
            plan_ahead(None, step, first)

        self.loader.plan_ahead = plan_nothing  # type: ignore[method-assign]


@contextlib.contextmanager
def _inline_load_workers() -> Iterator[None]:
    """Workers started inside this block are :class:`InlineLoadWorker` workers."""
    import planaria.control.pool as pool_module

    original = pool_module.Worker
    pool_module.Worker = InlineLoadWorker
    try:
        yield
    finally:
        pool_module.Worker = original


BREAKDOWN = (
    "worker_ms",
    "apply_ms",
    "worker_other_ms",
    "transport_ms",
    "bookkeeping_ms",
    "gap_ms",
    "controller_ms",
)


class RawRecords:
    """Every run's record, one JSON line each, in ``runs.jsonl`` under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def write(self, **record: Any) -> None:
        with open(self.root / "runs.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")


def _run_pair(args: argparse.Namespace, pair: str, size: str, i: int, wd: Path, raw: RawRecords,
              *, steps: int, warmup: int) -> dict[str, Any]:
    """Round ``i``'s planaria and DDP runs of ``pair``, recorded; the round's row."""
    inline = pair == "inline"
    runs: dict[str, dict[str, Any]] = {}
    for system in ("planaria", "train_step", "ddp"):
        if system == "train_step" and (inline or i >= args.train_step_rounds):
            continue
        load_before, t0 = common.loadavg(), time.time()
        if system == "ddp":
            run = run_ddp_steady(steps, size, args.replicas, args.threads, warmup=warmup,
                                 timeout_s=args.timeout_s, workdir=wd / f"ddp_{pair}_{size}_{i}",
                                 prefetch="none" if inline else ddp_prefetch(
                                     args.replicas, args.threads))
            # As planaria's figure: the time between two steps' ends (not the step's own).
            run = {**run, "step_ms": run["period_ms"]}
        else:
            driver = "run_steps" if system == "planaria" else "train_step"
            options = {"prefetch": False} if inline else {}
            with _inline_load_workers() if inline else contextlib.nullcontext():
                run = run_planaria_steady(steps, size, args.replicas, args.threads,
                                          warmup=warmup, driver=driver, **options,
                                          run_dir=wd / f"planaria_{driver}_{pair}_{size}_{i}")
        runs[system] = run
        raw.write(round=i, pair=pair, system=system, size=size, steps=steps, warmup=warmup,
                  step_ms=run["step_ms"], median_ms=_med(run["step_ms"]),
                  mean_ms=_mean(run["step_ms"]), t_start=t0, t_end=time.time(),
                  load_before=load_before, load_after=common.loadavg(),
                  **{k: run[f"{k}_median"] for k in BREAKDOWN if f"{k}_median" in run})
    pl, ddp = runs["planaria"], runs["ddp"]
    row: dict[str, Any] = {"pair": pair, "planaria_step_ms": _med(pl["step_ms"]),
                           "ddp_step_ms": _med(ddp["step_ms"]),
                           "planaria_step_ms_mean": _mean(pl["step_ms"]),
                           "ddp_step_ms_mean": _mean(ddp["step_ms"])}
    row["ratio"] = row["planaria_step_ms"] / row["ddp_step_ms"]
    one = runs.get("train_step")
    if one is not None:
        row["train_step_ms"] = _med(one["step_ms"])
        row["train_step_ms_mean"] = _mean(one["step_ms"])
        row["train_step_ratio"] = row["train_step_ms"] / row["ddp_step_ms"]
        row.update({k: one[f"{k}_median"] for k in BREAKDOWN})
    return row


def summarise_pair(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The pair's figures over its rounds (the estimator: module doc)."""
    ratios = [r["ratio"] for r in rows]
    diffs = [r["planaria_step_ms"] - r["ddp_step_ms"] for r in rows]
    pl_means = [r["planaria_step_ms_mean"] for r in rows]
    ddp_means = [r["ddp_step_ms_mean"] for r in rows]
    one = [r for r in rows if "train_step_ms" in r]
    out: dict[str, Any] = {
        "planaria_step_ms": _med([r["planaria_step_ms"] for r in rows]),
        "ddp_step_ms": _med([r["ddp_step_ms"] for r in rows]),
        "ratio": _med(ratios),
        "ratio_ci95": bootstrap_ci95(ratios),
        "fixed_ms": _med(diffs),
        "fixed_ms_ci95": bootstrap_ci95(diffs),
        "planaria_step_ms_mean": _mean(pl_means),
        "ddp_step_ms_mean": _mean(ddp_means),
        "ratio_of_means": _mean(pl_means) / _mean(ddp_means),
        "train_step_ms": _med([r["train_step_ms"] for r in one]) if one else None,
        "train_step_ms_mean": _mean([r["train_step_ms_mean"] for r in one]) if one else None,
        "train_step_ratio": _med([r["train_step_ratio"] for r in one]) if one else None,
        "rounds": rows,
    }
    out.update({k: _med([r[k] for r in one]) if one else None for k in BREAKDOWN})
    return out


def _compare(args: argparse.Namespace, size: str, pairs: list[str], wd: Path, raw: RawRecords,
             *, steps: int, warmup: int) -> dict[str, dict[str, Any]]:
    rows: dict[str, list[dict[str, Any]]] = {pair: [] for pair in pairs}
    for i in range(args.rounds):
        for pair in pairs if i % 2 == 0 else pairs[::-1]:
            row = _run_pair(args, pair, size, i, wd, raw, steps=steps, warmup=warmup)
            rows[pair].append(row)
            text = ""
            if "train_step_ms" in row:
                text = (f", {row['train_step_ms']:.2f} ms a train_step (slowest worker "
                        f"{row['worker_ms']:.1f} + apply {row['apply_ms']:.1f} ms, controller "
                        f"{row['controller_ms']:.1f} ms)")
            print(f"  round {i} ({size}, {pair}): planaria {row['planaria_step_ms']:.2f} ms "
                  f"(fit's runs){text}, DDP {row['ddp_step_ms']:.2f} ms, ratio "
                  f"{row['ratio']:.3f}; load {common.loadavg()}", flush=True)
    return {pair: summarise_pair(rows[pair]) for pair in pairs}


def _git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=_REPO, capture_output=True, text=True).stdout.strip()


def commit_label() -> str:
    """HEAD's short hash, ``-dirty`` if the tree has uncommitted changes to tracked files."""
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


SUMMARY_KEYS = ("planaria_step_ms", "ddp_step_ms", "ratio", "ratio_ci95", "fixed_ms",
                "fixed_ms_ci95", "controller_ms", "train_step_ms", "train_step_ratio",
                "planaria_step_ms_mean", "ddp_step_ms_mean", "ratio_of_means",
                "train_step_ms_mean", "rounds")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_overhead_"))
    wd.mkdir(parents=True, exist_ok=True)
    commit = commit_label()
    raw_dir = Path(args.raw_dir) if args.raw_dir else (
        wd / "raw" if args.quick else _REPO / "bench" / "results" / "raw" / "overhead" / commit)
    raw = RawRecords(raw_dir)
    command = " ".join(["python", "bench/overhead.py", *(sys.argv[1:] if argv is None else argv)])
    load_before = common.loadavg()
    t0 = time.time()
    print(
        f"overhead: size={args.size}, {args.replicas} replicas x {args.threads} thread, "
        f"{args.steps} steps ({args.warmup} warm-up), {args.rounds} rounds of the pairs "
        f"{', '.join(args.pairs)}; commit {commit}; raw records in {raw_dir}",
        flush=True,
    )
    by_pair = _compare(args, args.size, args.pairs, wd, raw, steps=args.steps, warmup=args.warmup)
    tiny = None
    if not args.no_tiny and args.size != "tiny":
        tiny = _compare(args, "tiny", [args.pairs[0]], wd, raw, steps=args.tiny_steps,
                        warmup=args.tiny_warmup)[args.pairs[0]]
    load_after = common.loadavg()
    main_pair = args.pairs[0]
    m = by_pair[main_pair]
    _print_table(args, by_pair, tiny)
    if m["train_step_ms"] is not None:
        _print_breakdown(m, args.train_step_rounds)
    print(f"load average before {load_before} after {load_after}; wall {time.time() - t0:.0f} s")

    out = {
        "bench": "overhead",
        "commit": commit,
        "command": command,
        "estimator": "median over rounds of paired ratios of run medians; "
                     "95% percentile bootstrap over rounds",
        "pair": main_pair,
        **{k: m[k] for k in SUMMARY_KEYS if k not in ("controller_ms", "rounds")},
        "controller_overhead_ms": m["controller_ms"],
        "ddp_prefetch": ddp_prefetch(args.replicas, args.threads) if main_pair != "inline"
        else "none",
        "breakdown_ms": {k: m[k] for k in BREAKDOWN},
        "pairs": {pair: {k: c[k] for k in SUMMARY_KEYS if k != "rounds"}
                  for pair, c in by_pair.items()},
        "tiny": None if tiny is None else {k: tiny[k] for k in SUMMARY_KEYS},
        "rounds": m["rounds"],
        "rounds_by_pair": {pair: c["rounds"] for pair, c in by_pair.items()},
        "train_step_rounds": args.train_step_rounds,
        "size": args.size,
        "replicas": args.replicas,
        "threads": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "global_batch": common.GLOBAL_BATCH,
        "micro_batch": common.MICRO_BATCH,
        "tiny_steps": None if tiny is None else args.tiny_steps,
        "tiny_warmup": None if tiny is None else args.tiny_warmup,
        "loadavg": {"before": load_before, "after": load_after},
        "nproc": os.cpu_count(),
        "raw_dir": str(raw_dir),
        "wall_s": time.time() - t0,
    }
    (raw_dir / "summary.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(out), flush=True)
    return out


def _print_table(args: argparse.Namespace, by_pair: dict[str, dict[str, Any]],
                 tiny: dict[str, Any] | None) -> None:
    print()
    print(f"{'':<44} {'planaria':>9} {'DDP':>9} {'ratio':>7}")
    rows = [(f"{pair}, {args.size}", c) for pair, c in by_pair.items()]
    if tiny is not None:
        rows.append((f"{args.pairs[0]}, tiny cross-check", tiny))
    for name, c in rows:
        print(f"{'median step ms (' + name + ')':<44} {c['planaria_step_ms']:>9.1f} "
              f"{c['ddp_step_ms']:>9.1f} {c['ratio']:>7.3f}")
    for name, c in rows:
        lo, hi = c["ratio_ci95"]
        flo, fhi = c["fixed_ms_ci95"]
        print(f"{name}: ratio {c['ratio']:.3f} (median of {args.rounds} paired ratios, 95% "
              f"interval {lo:.3f}-{hi:.3f}); fixed cost {c['fixed_ms']:+.2f} ms a step "
              f"({flo:+.2f} to {fhi:+.2f})")
    for name, c in rows:
        print(f"{name}: mean step ms planaria {c['planaria_step_ms_mean']:.2f}, DDP "
              f"{c['ddp_step_ms_mean']:.2f}, ratio of means {c['ratio_of_means']:.3f} "
              "(descriptive)")


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
