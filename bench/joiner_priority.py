"""What a replacement's start and join cost the survivors beside it: its setup's CPU
priority (``RunConfig.joiner_setup_priority``), its optimizer state in a dead worker's memory
(``RunConfig.joiner_memory_reserve``) and the route of its state (``RunConfig.state_by_memory``:
read out of the source's memory, or over the group), side by side.

    python bench/joiner_priority.py                  # realistic size, 3 replicas, 2 rounds
    python bench/joiner_priority.py --quick          # smoke run: small size, fewer steps
    python bench/joiner_priority.py --configs idle:on:group,idle:on:memory --rounds 3

Runs of planaria at the ``realistic`` size (bench/common.py: ~1 s steps, 1 GB of state), 3
replicas with 1 torch thread each, ``on_worker_lost="resize"``, a worker killed at the
dispatch of steps ``--first-kill``, then every ``--kill-every`` steps (chaos plan): w1
first, then each time the replacement that joined last (w3, w4, ...), so that from the
second kill on the dead worker is a joiner, whose memory its replacement can take
(``--victims random``: a random worker each time, the same ones for every configuration
of a round).
Each round runs every configuration of ``--configs`` (``PRIORITY:RESERVE[:ROUTE]``, the
priority ``worker``, ``lowest``: nice 19 or ``idle``: SCHED_IDLE, see
planaria.worker.low_priority; the reserve ``on`` or ``off``, see
planaria.worker.memory_reserve; the route ``memory`` (the default) or ``group``, see
planaria.worker.transfer_route), the order turning round by round.

Per kill, from the run's events: ``extra_s``, the survivors' steps between the
replacement's request and its join, each one's duration over the run's fault-free step
(the median step at full width, the steps of a join excluded), summed; ``join_extra_s``,
the join's step over it; ``transfer_s``, the survivors' wait for the state at the join
(``state_transfer``'s seconds: beside the step, the model's part); ``stall_s`` =
``transfer_s + join_extra_s``, the transfer stall as the goodput bench's floor counts it;
``ready_s`` and the replacement's start (``worker_started``).
Estimators, chosen before the runs: per configuration, the median over its kills of
``extra_s + join_extra_s`` (the cost) and of ``stall_s``; each configuration's saving
against the first in both, the median of the per-kill differences paired by round and
kill (the same seed kills the same places at the same steps), with its bootstrap 95 %
interval (``bench.stats.median_ci``). The priority and reserve compare by the cost, the
route by the stall.
On a node of its own a replacement competes with nobody and the priority changes
nothing: this measures the case where it shares the survivors' cores (a 2-core machine
here, as the goodput bench).

The last line printed is one JSON object (``"bench": "joiner_priority"``).
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


def run(config: str, size: str, steps: int, kills: list[int], run_dir: Path,
        seed: int, victims: str) -> dict[str, Any]:
    import planaria
    from bench.planaria_side import _ensure_worker_path, make_spec
    from planaria import RecoveryPolicy, RunConfig
    from planaria.observe.events import read_events

    _ensure_worker_path()
    cfg = RunConfig(steps=steps, replicas=3, run_dir=run_dir, threads_per_worker=1,
                    joiner_setup_priority=config.split(":")[0],
                    joiner_memory_reserve=config.split(":")[1] == "on",
                    state_by_memory=[*config.split(":"), "memory"][2] == "memory")
    policy = RecoveryPolicy(on_worker_lost="resize", min_replicas=1, max_failures=len(kills))
    names = (["random"] * len(kills) if victims == "random"
             else ["w1"] + [f"w{3 + i}" for i in range(len(kills) - 1)])
    chaos = planaria.ChaosPlan.parse(
        ",".join(f"kill:{name}@step{k}" for name, k in zip(names, kills, strict=True)), seed=seed)
    with planaria.Job(make_spec(size), cfg, policy=policy, chaos=chaos) as job:
        while job.steps_done < steps:
            try:
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
    return per_kill(list(read_events(run_dir / "events.jsonl")))


def per_kill(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of the module docstring, from one run's events."""
    commits = [e for e in events if e["event"] == "step_committed"]
    joins = {e["worker"]: e for e in events if e["event"] == "joined"}
    join_steps = {e["step"] for e in joins.values()}
    ref = statistics.median(c["duration_s"] for c in commits
                            if c["width"] == 3 and c["step"] not in join_steps)
    started = {e["worker"]: e for e in events if e["event"] == "worker_started"}
    transfers = {name: e for e in events if e["event"] == "state_transfer" for name in e["dst"]}
    out = []
    for ask in (e for e in events if e["event"] == "replacement_requested"):
        joined = joins.get(ask["worker"])
        if joined is None:
            continue
        between = [c for c in commits if ask["t"] < c["t"] and c["step"] < joined["step"]
                   and c["width"] < 3]
        join_step = next((c for c in commits if c["step"] == joined["step"]), None)
        start = started.get(ask["worker"], {})
        transfer = transfers.get(ask["worker"])
        transfer_s = transfer["seconds"] if transfer else 0.0
        join_extra_s = (join_step["duration_s"] - ref) if join_step else None
        out.append({
            "extra_s": sum(c["duration_s"] - ref for c in between),
            "steps_beside": len(between),
            "join_extra_s": join_extra_s,
            "transfer_s": transfer_s,
            "stall_s": transfer_s + (join_extra_s or 0.0),
            "ready_s": start.get("ready_s"),
            "reserve": start.get("reserve"),
            "start": {k: start.get(k) for k in ("process_s", "build_s", "warm_s",
                                                "prebuild_s", "setup_s")},
        })
    return {"step_s": ref, "kills": out}


def cost(kill: dict[str, Any]) -> float:
    return kill["extra_s"] + (kill["join_extra_s"] or 0.0)


def main() -> None:
    from bench import records
    from bench.stats import median_ci

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--size", default="realistic")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="worker:off,worker:on,idle:on")
    ap.add_argument("--first-kill", type=int, default=8)
    ap.add_argument("--kill-every", type=int, default=20)
    ap.add_argument("--kills", type=int, default=4)
    ap.add_argument("--victims", choices=("chain", "random"), default="chain")
    ap.add_argument("--quick", action="store_true", help="small size, 2 kills, 1 round")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    if args.quick:
        args.size, args.kills, args.rounds, args.kill_every = "small", 2, 1, 15
    kills = [args.first_kill + i * args.kill_every for i in range(args.kills)]
    steps = kills[-1] + args.kill_every
    priorities = args.configs.split(",")
    base = Path(tempfile.mkdtemp(prefix="planaria-joiner-priority-", dir=args.workdir))
    commit = records.tree_commit()
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in priorities}
    for r in range(args.rounds):
        turn = r % len(priorities)
        for priority in priorities[turn:] + priorities[:turn]:
            got = run(priority, args.size, steps, kills,
                      base / f"r{r}-{priority.replace(':', '-')}", seed=r, victims=args.victims)
            runs[priority].append(got)
            costs = [round(cost(k), 3) for k in got["kills"]]
            stalls = [round(k["stall_s"], 3) for k in got["kills"]]
            print(f"round {r} {priority}: step {got['step_s']:.3f} s, cost per kill {costs}, "
                  f"stall per kill {stalls}, "
                  f"starts {[k['start'] for k in got['kills']]}", flush=True)
    summary: dict[str, Any] = {"bench": "joiner_priority", "commit": commit,
                               "command": " ".join(sys.argv), "size": args.size,
                               "cpus": os.cpu_count(), "kills_at": kills,
                               "victims": args.victims}
    for p in priorities:
        per = [cost(k) for g in runs[p] for k in g["kills"]]
        stalls = [k["stall_s"] for g in runs[p] for k in g["kills"]]
        summary[p] = {"cost_per_kill_s_median": round(statistics.median(per), 3),
                      "stall_per_kill_s_median": round(statistics.median(stalls), 3),
                      "kills": len(per), "costs": [round(c, 3) for c in per],
                      "stalls": [round(c, 3) for c in stalls],
                      "ready_s": [k["ready_s"] for g in runs[p] for k in g["kills"]]}
    for p in priorities:
        if p == priorities[0]:
            continue
        # Paired by round and kill: the same seed picks the same victims at the same steps.
        pairs = [(x, y) for ga, gb in zip(runs[priorities[0]], runs[p], strict=True)
                 for x, y in zip(ga["kills"], gb["kills"], strict=False)]
        summary[f"saved_per_kill_s_{p}"] = median_ci(
            [cost(x) - cost(y) for x, y in pairs]).as_dict(3)
        summary[f"stall_saved_per_kill_s_{p}"] = median_ci(
            [x["stall_s"] - y["stall_s"] for x, y in pairs]).as_dict(3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
