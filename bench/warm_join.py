"""A compiled model's replacement joining cold (compiling from scratch) against warm (from a
running worker's compile cache), side by side.

    python bench/warm_join.py              # tiny GPT, compiled, 2 replicas
    python bench/warm_join.py --quick      # smoke run: a smaller tiny GPT

Two planaria runs of the compiled tiny GPT (``TrainSpec(compile=True)``), 2
replicas, 1 torch thread each: one with ``share_compile_cache=False`` (every
worker compiles from scratch: cold) and one with the default (workers started
later unpack a running worker's cache first: warm). In each, w1 is SIGKILLed at
step ``--kill-at`` and the job waits at full width for the replacement.

``join_s`` = the replacement asked for → the first committed step that
includes it (its process start, imports, model build, compile, the state
transfer and that step); the event log's breakdown of its start
(``worker_started``) is printed too.

The last line printed is one JSON object (``"bench": "warm_join"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))


def run(share: bool, steps: int, kill_at: int, run_dir: Path, small: bool) -> dict[str, Any]:
    import planaria
    from planaria import RunConfig
    from planaria.examples import tiny_gpt
    from planaria.observe.events import read_events

    spec = dataclasses.replace(
        tiny_gpt.make_spec(**({"dim": 64, "layers": 1} if small else {})), compile=True)
    cfg = RunConfig(steps=steps, replicas=2, run_dir=run_dir, threads_per_worker=1,
                    share_compile_cache=share)
    job = planaria.Job(spec, cfg, chaos=planaria.ChaosPlan.parse(f"kill:w1@step{kill_at}"))
    with job:
        while job.steps_done < steps:
            if job.steps_done == kill_at + 1:
                job.wait_for_width(2, timeout_s=900)
            try:
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
    evs = list(read_events(run_dir / "events.jsonl"))
    asked = next(e for e in evs if e["event"] == "replacement_requested")
    joined = next(e for e in evs if e["event"] == "joined" and e["worker"] == asked["worker"])
    started = {e["worker"]: e for e in evs if e["event"] == "worker_started"}
    keys = ("process_s", "build_s", "data_s", "compile_s", "setup_s", "ready_s")
    return {"join_s": joined["t"] - asked["t"],
            "replacement": {k: started[asked["worker"]].get(k) for k in keys},
            "first_worker": {k: started["w0"].get(k) for k in keys}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kill-at", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a smaller model (smoke test)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="planaria-warm-join-", dir=args.workdir))
    out: dict[str, Any] = {"bench": "warm_join", "cpus": os.cpu_count(), "quick": args.quick}
    for share in (False, True):
        name = "warm" if share else "cold"
        r = run(share, args.steps, args.kill_at, base / name, args.quick)
        out[name] = r
        rep = {k: round(v, 2) for k, v in r["replacement"].items() if v is not None}
        print(f"{name}: the replacement joined {r['join_s']:.2f} s after it was asked for; "
              f"its start {rep}", flush=True)
    cold, warm = out["cold"]["join_s"], out["warm"]["join_s"]
    print(json.dumps({"bench": "warm_join", "cold_join_s": round(cold, 3),
                      "warm_join_s": round(warm, 3), "warm_over_cold": round(warm / cold, 4),
                      "details": out}))


if __name__ == "__main__":
    main()
