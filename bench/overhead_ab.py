"""The overhead bench at two commits, side by side: is planaria's fault-free step slower at B
than at A?

    python bench/overhead_ab.py --a /path/to/checkout-A --b /path/to/checkout-B --pairs 5

Runs ``bench/overhead.py --rounds 1`` (planaria and DDP side by side, the ``small`` model
and the ``tiny`` cross-check) from checkouts A and B, ``--pairs`` times, alternating, so
that both see the same drift of the machine; the pairs alternate their order too (A then B,
B then A, ...): on a machine whose load drifts within a pair, the side run second is not
always the same one. Each run's ratio (planaria ÷
DDP, the medians of its steady steps; at a checkout whose overhead bench runs both pairs,
the ``like_for_like`` one) is one observation; pass ``--args-a``/``--args-b`` ``--pairs
like_for_like`` to a checkout that has the option to skip its ``inline`` pair. The estimator, chosen
before the runs: the median of each checkout's ratios, and B's median minus A's with a 95%
interval bootstrapped over the pairs (a pair's two runs resampled together). B is not
slower where the interval's upper end is at most the bound asked for.

The last line printed is one JSON object (``"bench": "overhead_ab"``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _run(tree: Path, extra: list[str], workdir: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "bench/overhead.py", "--rounds", "1", "--workdir", str(workdir),
           *extra]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _commit(tree: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree,
                          capture_output=True, text=True).stdout.strip()


def _interval(a: list[float], b: list[float]) -> list[float]:
    import numpy as np

    rng = np.random.default_rng(0)
    diffs = []
    for _ in range(4000):
        pick = rng.integers(0, len(a), len(a))
        diffs.append(statistics.median(b[i] for i in pick) - statistics.median(a[i] for i in pick))
    return [float(v) for v in np.percentile(diffs, (2.5, 97.5))]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, help="checkout A (the baseline)")
    p.add_argument("--b", required=True, help="checkout B")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--args-a", default="", help="extra overhead.py arguments at A")
    p.add_argument("--args-b", default="", help="extra overhead.py arguments at B")
    p.add_argument("--workdir", default="/tmp/overhead_ab")
    args = p.parse_args(argv)
    a, b = Path(args.a).resolve(), Path(args.b).resolve()
    runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    t0 = time.time()
    for i in range(args.pairs):
        order = (("a", a, args.args_a), ("b", b, args.args_b))
        for side, tree, extra in order if i % 2 == 0 else order[::-1]:
            r = _run(tree, extra.split(), Path(args.workdir) / f"{side}{i}")
            runs[side].append(r)
            print(f"  pair {i} {side.upper()} ({_commit(tree)}): ratio {r['ratio']:.3f} "
                  f"(planaria {r['planaria_step_ms']:.2f} ms, DDP {r['ddp_step_ms']:.2f} ms)"
                  + (f"; tiny {r['tiny']['ratio']:.3f}" if r.get("tiny") else ""), flush=True)
    out: dict[str, Any] = {"bench": "overhead_ab", "a": _commit(a), "b": _commit(b),
                           "pairs": args.pairs}
    for name, get in (("ratio", lambda r: r["ratio"]),
                      ("tiny_ratio", lambda r: (r.get("tiny") or {}).get("ratio")),
                      ("ratio_of_means", lambda r: r["ratio_of_means"]),
                      ("tiny_ratio_of_means",
                       lambda r: (r.get("tiny") or {}).get("ratio_of_means")),
                      ("planaria_step_ms", lambda r: r["planaria_step_ms"]),
                      ("ddp_step_ms", lambda r: r["ddp_step_ms"]),
                      ("train_step_ms", lambda r: r.get("train_step_ms"))):
        xa = [get(r) for r in runs["a"]]
        xb = [get(r) for r in runs["b"]]
        if None in xa or None in xb:  # not measured (--train-step-rounds 0, --no-tiny)
            continue
        out[name] = {"a": xa, "b": xb, "a_median": statistics.median(xa),
                     "b_median": statistics.median(xb),
                     "b_minus_a": statistics.median(xb) - statistics.median(xa),
                     "b_minus_a_ci95": _interval(xa, xb)}
        print(f"{name}: A {out[name]['a_median']:.3f}, B {out[name]['b_median']:.3f}, B - A "
              f"{out[name]['b_minus_a']:+.3f} (95% interval {out[name]['b_minus_a_ci95'][0]:+.3f}"
              f" to {out[name]['b_minus_a_ci95'][1]:+.3f})")
    out["order"] = ["ab" if i % 2 == 0 else "ba" for i in range(args.pairs)]
    out["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    out["runs"] = runs  # every run's own figures, as overhead.py printed them
    out["wall_s"] = time.time() - t0
    out["command"] = " ".join(["python", "bench/overhead_ab.py", *sys.argv[1:]])
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
