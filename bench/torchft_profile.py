"""torchft's step beside DDP's on the same work: interleaved fault-free runs, per phase.

    python bench/torchft_profile.py --steps 60 --rounds 3
    python bench/torchft_profile.py --modes before,bucket,ddp   # needs the earlier loop:
    #   git show 27bbeb6:bench/baselines/torchft_train.py > bench/baselines/torchft_train_before.py

Each round runs every mode once, in order (so a change in the machine's load hits every
mode alike). A mode is ``torchft_runners.run_torchft_steady`` (the ``--size`` model on
``--groups``
groups, 1 thread each, heartbeat 1000 ms, gloo 10 s) with the loop's options, or
``runners.run_ddp_steady`` on as many ranks. Prints one JSON line per run (group 0's median
steady step, its per-phase medians, the 1-minute load average when the run started) and
then the median over rounds of each mode's median, and of its ratio to DDP's median in the
same round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.baselines.runners import run_ddp_steady
from bench.baselines.torchft_config import TorchftConfig
from bench.baselines.torchft_runners import run_torchft_steady


def modes(args: argparse.Namespace) -> dict[str, Callable[[], dict[str, Any]]]:
    def ft(async_quorum: bool = True, **kw: Any) -> Callable[[], dict[str, Any]]:
        config = TorchftConfig(heartbeat_ms=1000, pg_timeout_s=10.0, async_quorum=async_quorum)
        return lambda: run_torchft_steady(args.steps, args.size, args.groups, config=config,
                                          **kw)

    return {
        "bucket": ft(),
        "bucket_sync": ft(async_quorum=False),
        "bucket_noprefetch": ft(prefetch="none"),
        "torchft_ddp": ft(grads="torchft-ddp"),
        "before": ft(script="torchft_train_before.py"),
        "before_sync": ft(async_quorum=False, script="torchft_train_before.py"),
        "ddp": lambda: run_ddp_steady(args.steps, args.size, args.groups, 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", default="medium")
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--modes", default="bucket,bucket_sync,torchft_ddp,ddp")
    args = p.parse_args(argv)
    runs, chosen = modes(args), args.modes.split(",")
    medians: dict[str, list[float]] = {m: [] for m in chosen}
    for r in range(args.rounds):
        for m in chosen:
            load = os.getloadavg()[0]
            res = runs[m]()
            medians[m].append(res["step_ms_median"])
            print(json.dumps({"mode": m, "round": r, "step_ms_median": res["step_ms_median"],
                              "phases_ms_median": res.get("phases_ms_median"),
                              "load1": round(load, 2)}), flush=True)
    summary: dict[str, Any] = {m: {"step_ms": statistics.median(v)} for m, v in medians.items()}
    if "ddp" in medians:
        for m, v in medians.items():
            summary[m]["vs_ddp"] = statistics.median(
                a / b for a, b in zip(v, medians["ddp"], strict=True))
    print(json.dumps({"bench": "torchft_profile", "size": args.size, "groups": args.groups,
                      "steps": args.steps, "rounds": args.rounds, "modes": summary}))


if __name__ == "__main__":
    main()
