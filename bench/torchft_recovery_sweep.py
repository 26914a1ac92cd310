"""torchft's fastest single-kill recovery: its heartbeat timeout and quorum tick swept down.

    python bench/torchft_recovery_sweep.py      # 50/20, 25/10, 10/5 ms, 5 kills each
    python bench/torchft_recovery_sweep.py --settings 25/10,20/5 --repeats 3

Each setting (``heartbeat_ms/quorum_tick_ms``; gloo timeout 2 s, async quorum, no standby)
runs ``--repeats`` kills of the recovery bench's workload (``medium`` model, 3 replica groups,
60 steps, the victim killing itself a third of a step into step 30-32 picked by seed, its
replacement started 3 s later: ``torchft_runners.run_torchft_kill``, as ``bench/recovery.py``
runs it), interleaved (repeat 0 of every setting, then repeat 1, ...). The estimator, per
setting: the median ``back_s`` (kill → a step beyond every step committed before). The
setting with the lowest median is torchft's best for one kill; ``bench/recovery.py
--torchft-config FILE`` then runs it side by side with planaria. The last line printed is
one JSON object (``"bench": "torchft_recovery_sweep"``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import records
from bench.baselines import torchft_runners
from bench.baselines.torchft_config import TorchftConfig


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="50/20,25/10,10/5",
                   help="heartbeat_ms/quorum_tick_ms pairs, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=200)
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    configs = []
    for pair in args.settings.split(","):
        hb, tick = (int(x) for x in pair.split("/"))
        configs.append(TorchftConfig(heartbeat_ms=hb, quorum_tick_ms=tick, pg_timeout_s=2.0,
                                     async_quorum=True, warm_standby=False))
    wd = Path(args.workdir or tempfile.mkdtemp(prefix="torchft_recovery_sweep_"))
    runs: dict[str, list[float | None]] = {c.label(): [] for c in configs}
    for rep in range(args.repeats):
        rng = random.Random(args.seed + rep)
        victim, kill_at = rng.randrange(3), 30 + rng.randrange(3)
        for c in configs:
            r = torchft_runners.run_torchft_kill(
                60, kill_at, "medium", groups=3, victim=victim, restart_delay_s=3.0,
                timeout_s=300, workdir=wd / f"{c.label().replace(' ', '_')}-{rep}", config=c)
            runs[c.label()].append(r.get("back_s"))
            print(f"{c.label()} repeat {rep}: back_s {r.get('back_s')}", flush=True)
    table = []
    for c in configs:
        values = [v for v in runs[c.label()] if v is not None]
        table.append({"label": c.label(), "config": c.as_dict(), "back_s_all": runs[c.label()],
                      "back_s_median": statistics.median(values) if values else None})
    best = min((t for t in table if t["back_s_median"] is not None),
               key=lambda t: t["back_s_median"], default=None)
    out = {"bench": "torchft_recovery_sweep", "commit": records.tree_commit(),
           "repeats": args.repeats, "seed": args.seed, "table": table,
           "best": None if best is None else best["config"], "workdir": str(wd)}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
