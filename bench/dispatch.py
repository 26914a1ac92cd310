"""The controller's per-step cost against the number of workers, today's step protocol.

    python bench/dispatch.py                # 3 real workers; 3-48 protocol-only workers
    python bench/dispatch.py --quick        # smoke run

Today the controller makes one Ray call per worker per step and waits for every
answer (``Job.train_step``). This measures what that costs the controller, the
baseline the step-protocol work (workers running steps on their own between
membership changes) is to be compared against, side by side, when it lands:

- ``old_per_step_controller_ms[N]``: one round of the step protocol's calls to
  N *protocol-only* workers (Ray actors that import neither torch nor planaria
  and answer at once with a step result of planaria's shape): the dispatch of N
  calls with their arguments (ids of the step's share), and the same wait as
  ``Job._gather`` (``ray.wait`` for the first answer, then a sweep). Worker
  compute is zero, so the round is all controller and transport; on this
  machine the N actors share its cores (labelled ``oversubscribed`` above the
  core count);
- ``real_workers_controller_ms``: with 3 real planaria workers on the tiny
  model, the step period minus the slowest worker's own data + compute +
  reduce + apply (``bench/overhead.py``'s ``controller_ms``).

The last line printed is one JSON object (``"bench": "dispatch"``).
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

import numpy as np  # noqa: E402
import ray  # noqa: E402

from bench import common  # noqa: E402


@ray.remote(num_cpus=0)
class ProtocolWorker:
    """Answers the step protocol's call at once, with a result of the real one's shape."""

    def step(self, gen: int, step: int, ids: Any, steps_done: int, next_ids: Any,
             *, skipped: int = -1) -> dict[str, Any]:
        return {"grad_norm": 1.0, "overflow": False, "loss_sum": 0.5, "n": len(ids),
                "metric_sums": {}, "ids": ids, "digests": None, "data_wait_s": 0.0,
                "compute_s": 0.0, "reduce_s": 0.0, "preempting": False}


def _gather(refs: list[Any]) -> list[Any]:
    """``Job._gather``'s wait: the first answer, then a sweep of what else is ready."""
    pending = list(refs)
    out = []
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=0.25)
        if done and pending:
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            done += more
        out += ray.get(done)
    return out


def protocol_rounds(n: int, rounds: int, warmup: int) -> float:
    """Median ms of one step's round of calls to ``n`` protocol-only workers."""
    workers = [ProtocolWorker.remote() for _ in range(n)]  # type: ignore[attr-defined]
    ray.get([w.__ray_ready__.remote() for w in workers])
    batch = np.arange(common.GLOBAL_BATCH, dtype=np.int64)
    parts = np.array_split(batch, n)
    times = []
    for step in range(rounds + warmup):
        t0 = time.perf_counter()
        refs = [w.step.remote(0, step, parts[r], step, parts[r], skipped=-1)
                for r, w in enumerate(workers)]
        _gather(refs)
        if step >= warmup:
            times.append((time.perf_counter() - t0) * 1000)
    for w in workers:
        ray.kill(w)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="3,8,16,32,48")
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--real-steps", type=int, default=40)
    p.add_argument("--quick", action="store_true", help="smoke run: few workers, few rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.rounds, args.warmup, args.real_steps = "3,8", 20, 5, 12
    counts = [int(x) for x in args.workers.split(",")]
    cores = os.cpu_count() or 1
    load_before = common.loadavg()
    ray.init(address="local", num_cpus=max(8, cores), include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        old = {}
        for n in counts:
            old[str(n)] = protocol_rounds(n, args.rounds, args.warmup)
            label = " (oversubscribed)" if n > cores else ""
            print(f"  {n:3d} protocol-only workers{label}: {old[str(n)]:.2f} ms a step",
                  flush=True)
    finally:
        ray.shutdown()
    from bench.planaria_side import run_planaria_steady

    # planaria starts its own Ray (with the bench's modules on the workers' path)
    real = run_planaria_steady(args.real_steps, "tiny", 3, 1,
                               warmup=min(10, args.real_steps // 3),
                               run_dir=Path(tempfile.mkdtemp(prefix="bench_dispatch_")))
    first, last = str(counts[0]), str(counts[-1])
    out = {
        "bench": "dispatch",
        "protocol": "old: one Ray call per worker per step (Job.train_step)",
        "per_step_controller_ms": None,  # the autonomous loop is not built yet
        "old_per_step_controller_ms": old,
        "old_growth_last_over_first": old[last] / old[first],
        "real_workers_controller_ms": real["controller_ms_median"],
        "real_workers_transport_ms": real["transport_ms_median"],
        "real_workers_step_ms": real["step_ms_median"],
        "cores": cores,
        "oversubscribed_above": cores,
        "loadavg": {"before": load_before, "after": common.loadavg()},
    }
    print(f"old protocol: {old[first]:.2f} ms a step at {first} workers, {old[last]:.2f} ms at "
          f"{last} ({out['old_growth_last_over_first']:.1f}x); 3 real workers (tiny model): "
          f"controller {out['real_workers_controller_ms']:.2f} ms of a "
          f"{out['real_workers_step_ms']:.2f} ms step")
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
