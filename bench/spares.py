"""Back to full width after a SIGKILL, with and without a hot spare, side by side.

    python bench/spares.py                 # 3 replicas, "medium" model, 3 kills per run
    python bench/spares.py --quick         # smoke run: tiny model, one kill

Two planaria runs of the same workload (``bench.common``, 3 replicas, 1 torch
thread each, resize policy), one with ``spares=1`` and one without. Each waits
until its spares are warm, then SIGKILLs a member (a different one each time) at
the boundaries of steps ``--kill-every``, ``2 * --kill-every``, ...; before each
kill it waits until the job is back at full width (and, with spares, until a
spare stands by again), so every kill meets the same situation.

``full_width_s`` (per kill, then the median): the SIGKILL → the first committed
step at full width (every replica in, the replacement holding the state).
Without a spare that includes a fresh worker's start (process, imports, model);
with one, only the detection, the new generation and the state transfer.

The last line printed is one JSON object (``"bench": "spares"``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
from bench.planaria_side import _ensure_worker_path, make_spec  # noqa: E402


def run(size: str, replicas: int, spares: int, kills: int, every: int, run_dir: Path
        ) -> dict[str, Any]:
    import planaria
    from planaria import RunConfig
    from planaria.observe.events import read_events

    _ensure_worker_path()
    steps = every * (kills + 1)
    cfg = RunConfig(steps=steps, replicas=replicas, run_dir=run_dir, threads_per_worker=1,
                    spares=spares)
    kill_t: list[float] = []
    kill_at = [every * (i + 1) for i in range(kills)]  # step boundaries
    with planaria.Job(make_spec(size), cfg) as job:
        job.wait_for_spares(timeout_s=300)
        while job.steps_done < steps:
            if kill_at and job.steps_done == kill_at[0]:
                kill_at.pop(0)
                job.wait_for_width(replicas, timeout_s=300)
                job.wait_for_spares(timeout_s=300)
                victim = job.members[len(kill_t) % replicas]
                kill_t.append(time.time())
                os.kill(victim.pid, signal.SIGKILL)
            if job.steps_done == steps - 1:
                job.wait_for_width(replicas, timeout_s=300)  # the last kill's figure too
            try:
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
    evs = list(read_events(run_dir / "events.jsonl"))
    commits = [e for e in evs if e["event"] == "step_committed"]
    full = []
    for t in kill_t:
        back = next((e["t"] for e in commits if e["t"] > t and e["width"] == replicas), None)
        full.append(None if back is None else back - t)
    steady = [e["duration_s"] for e in commits[2:every]]
    return {"full_width_s": full, "step_s": statistics.median(steady) if steady else None,
            "spares_taken": sum(1 for e in evs if e["event"] == "replacement_requested"
                                and e.get("spare"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="medium", choices=sorted(common.SIZES))
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--kill-every", type=int, default=10, help="steps between kills")
    ap.add_argument("--quick", action="store_true", help="tiny model, one kill (smoke test)")
    ap.add_argument("--workdir", default=None, help="where the run dirs go (default: a tmp dir)")
    args = ap.parse_args()
    if args.quick:
        args.size, args.kills, args.kill_every = "tiny", 1, 4
    base = Path(tempfile.mkdtemp(prefix="planaria-spares-", dir=args.workdir))
    out: dict[str, Any] = {"bench": "spares", "size": args.size, "replicas": args.replicas,
                           "kills": args.kills, "cpus": os.cpu_count(), "quick": args.quick}
    for spares in (1, 0):
        r = run(args.size, args.replicas, spares, args.kills, args.kill_every,
                base / f"spares{spares}")
        key = "spare" if spares else "no_spare"
        out[f"full_width_s_{key}"] = r["full_width_s"]
        ok = [x for x in r["full_width_s"] if x is not None]
        out[f"median_full_width_s_{key}"] = statistics.median(ok) if ok else None
        out[f"step_s_{key}"] = r["step_s"]
        out[f"spares_taken_{key}"] = r["spares_taken"]
        print(f"{'with a spare' if spares else 'without spares'}: back at full width "
              f"{[None if x is None else round(x, 3) for x in r['full_width_s']]} s after "
              f"each kill (steps of {r['step_s'] or 0:.3f} s)", flush=True)
    a, b = out["median_full_width_s_spare"], out["median_full_width_s_no_spare"]
    out["spare_over_no_spare"] = None if a is None or b is None else round(a / b, 4)
    print(json.dumps({"bench": "spares",
                      "full_width_s_spare": a, "full_width_s_no_spare": b,
                      "spare_over_no_spare": out["spare_over_no_spare"], "details": out}))


if __name__ == "__main__":
    main()
