"""The gradient all-reduce overlapped with backward against reduce-after-backward, side by side.

    python bench/overlap.py                # "medium" model, 3 replicas, 3 rounds of 30 steps
    python bench/overlap.py --quick        # smoke run: tiny model, few steps

The same planaria job (``bench.common`` workload, 1 torch thread per worker) run
with ``RunConfig(overlap_reduction=False)`` and ``True``, interleaved round by
round so both see the same machine load. Figures: the median step period
(``step_ms``, the driver loop's wall time per ``train_step``) and the slowest
worker's ``compute_ms + reduce_ms`` (with overlap, part of the reduction hides
in the compute, so their sum is what to compare), each the median over the
rounds.

The last line printed is one JSON object (``"bench": "overlap"``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from bench import common  # noqa: E402
from bench.planaria_side import run_planaria_steady  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="medium", choices=sorted(common.SIZES))
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    if args.quick:
        args.size, args.steps, args.rounds, args.replicas = "tiny", 8, 1, 2
    base = Path(tempfile.mkdtemp(prefix="planaria-overlap-", dir=args.workdir))
    rows: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for i in range(args.rounds):
        for overlap in (False, True):
            r = run_planaria_steady(args.steps, args.size, args.replicas,
                                    run_dir=base / f"{'overlap' if overlap else 'plain'}{i}",
                                    overlap_reduction=overlap)
            rows[overlap].append(r)
            print(f"round {i} {'overlap' if overlap else 'plain  '}: step "
                  f"{r['step_ms_median']:.1f} ms (worker {r['worker_ms_median']:.1f} ms)",
                  flush=True)

    def med(overlap: bool, key: str) -> float:
        return statistics.median(r[key] for r in rows[overlap])

    out = {"bench": "overlap",
           "step_ms_overlap": round(med(True, "step_ms_median"), 3),
           "step_ms_plain": round(med(False, "step_ms_median"), 3),
           "worker_ms_overlap": round(med(True, "worker_ms_median"), 3),
           "worker_ms_plain": round(med(False, "worker_ms_median"), 3)}
    out["overlap_over_plain"] = round(out["step_ms_overlap"] / out["step_ms_plain"], 4)
    out["details"] = {"size": args.size, "replicas": args.replicas, "steps": args.steps,
                      "rounds": args.rounds, "cpus": os.cpu_count(), "quick": args.quick}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
