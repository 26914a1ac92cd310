"""Recovery from one SIGKILL, three ways, in one run: planaria, torchrun + checkpoints, torchft.

    python bench/recovery.py                  # 3 replicas, "medium" model, kill near step 30 of 60
    python bench/recovery.py --quick          # smoke run: tiny model, few steps
    python bench/recovery.py --rescore DIR    # the paired figures again from DIR's raw records

Every system trains the same workload (``bench.common``) on 3 replicas with 1
torch thread each, and one worker is SIGKILLed inside step ``--kill-at``, a third of a
typical step in (planaria's and torchft's kills land at the same point of the step;
torchrun's once a worker logged the step before):

- planaria: resize policy, the kill sent by planaria's own chaos plan
  (``kill:w1@stepK``); the survivors go on at width 2 and a replacement joins
  live, receiving the state from a survivor. Figures from ``events.jsonl``.
- torchrun: DDP with a checkpoint every ``--ckpt-every`` steps under
  ``torchrun --max-restarts``; every worker restarts and resumes from the
  checkpoint (``bench.baselines.runners.run_torchrun_kill``).
- torchft: one replica group per process and a lighthouse; the victim kills itself at
  that point of the step (``torchft_train.py --die-at-step``); survivors go on,
  a replacement heals from a peer (``run_torchft_kill``), started
  ``--torchft-restart-delay-s`` (3 s) after the kill. torchft runs at the configuration
  the goodput bench uses, the sweep's best (``bench/baselines/torchft_config.load_best``,
  or ``--torchft-config FILE``), named in the output as ``torchft.config`` (with
  ``torchft.config_applied``: the fields the runner applied).

Repeats (``--repeat``, 3), interleaved (repeat 0 runs every system, then repeat 1, ...),
each with its own seed ``--seed + repeat``, which picks the victim (the same rank for every
system where the runner takes one) and the kill step (``--kill-at`` plus 0-2). The
estimators, fixed before any run: per system the median ``back_s`` over the repeats with
its bootstrap 95 % interval; ``speedup_vs_torchft`` / ``speedup_vs_torchrun`` = the median
of the per-repeat ratios ``peer back_s ÷ planaria back_s``, with the paired bootstrap
interval (``bench/stats.py``), "ahead" only where its low end is above 1. planaria's
``lost_work_per_kill_steps``: ``redone / total`` micro-batches of its ``step_resumed``
record after the kill (null where its log has none: not measured). Every kill run's raw
record goes to ``--raw-dir/recovery/<size>/<commit>/<system>-r<repeat>.json``
(``bench/records.py``; ``--quick``: under the workdir), and ``--rescore`` recomputes the
paired figures from them (``bench/recovery_summary.py``).

The same definitions for all three (see ``bench/baselines/runners.py``):
``recover_s`` = kill → next committed step; ``back_s`` = kill → first commit of
a step beyond the highest step committed before the kill; ``lost_steps`` =
steps committed twice. For planaria also ``join_s`` (replacement ready → first
committed step that includes it, from the ``joined`` event) and the state
transfer throughput (``state_transfer`` event: bytes ÷ seconds, the seconds
covering the layout request and the send/receive; a transfer beside the step, whose record
times the model's part alone: bytes ÷ that part's seconds plus the rest's, the joiner's
``state_received``, read while the step computes). The transfer figure needs
≥100 MB of state: when ``--size`` is smaller it comes from a second planaria
run with the ``--transfer-size`` model (default ``large``: ~132 MB with Adam).

Then, planaria alone (``--no-scaling`` skips it), recovery against the state's
size and the replica count: the kill → first commit back at full width
(``full_width_s``: the replacement started, received the state and stepped)
with ~10 MB, ~130 MB and ~0.9 GB of state (parameters and Adam's moments) at 2
replicas, and with 2, 4 and 8 replicas of the ~10 MB model (in micro-batches
of 6, so that 8 ranks get one each; above this machine's cores the replicas
share them: labelled oversubscribed), each with its state transfer's size and
throughput.

The last line printed is one JSON object (``"bench": "recovery"``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from bench import common, records  # noqa: E402
from bench.baselines import runners, torchft_runners  # noqa: E402
from bench.baselines.torchft_config import TorchftConfig, load_best  # noqa: E402
from bench.planaria_side import run_planaria_kill  # noqa: E402
from bench.recovery_summary import summarize  # noqa: E402
from planaria.observe.events import read_events  # noqa: E402

MIN_TRANSFER_BYTES = 100 * 10**6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="medium", choices=sorted(common.SIZES))
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at", type=int, default=30, help="SIGKILL once this step runs")
    p.add_argument("--ckpt-every", type=int, default=20, help="torchrun's checkpoint interval")
    p.add_argument(
        "--repeat", "--repeats", type=int, default=3,
        help="kill runs per system, each with its own seed; the median run is reported"
    )
    p.add_argument("--seed", type=int, default=0, help="repeat r's victim and step: seed + r")
    p.add_argument("--torchft-config", default=None,
                   help="a file holding a JSON TorchftConfig (or {'config': {...}}); "
                   "default: the sweep's best")
    p.add_argument("--raw-dir", default=None,
                   help="where raw records go (default: bench/results/raw; --quick: WORKDIR/raw)")
    p.add_argument("--rescore", default=None, metavar="DIR",
                   help="run nothing: the paired figures from DIR's raw records")
    p.add_argument("--transfer-size", default="large", choices=sorted(common.SIZES))
    p.add_argument("--transfer-steps", type=int, default=10)
    p.add_argument(
        "--torchft-restart-delay-s",
        type=float,
        default=3.0,
        help="when the torchft replacement starts after the kill: a replacement that starts "
        "at once heartbeats under the dead group's id and the lighthouse waits for it to join "
        "(seen here: survivors stalled ~10 s); a few seconds later, as a scheduler would, "
        "lets survivors go on after the heartbeat timeout, torchft's best case",
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each baseline run")
    p.add_argument("--workdir", default=None, help="where runs write (default: a temp dir)")
    p.add_argument("--no-scaling", action="store_true",
                   help="skip recovery against state size and replica count")
    p.add_argument("--scaling-sizes", default="state_10mb,large,state_1gb")
    p.add_argument("--scaling-replicas", default="2,4,8")
    p.add_argument("--scaling-steps", type=int, default=10, help="steps a scaling run")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, few steps")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.transfer_size = "tiny", "tiny"
        args.steps, args.kill_at, args.ckpt_every, args.transfer_steps = 12, 6, 4, 0
        args.repeat = 1
        args.scaling_sizes, args.scaling_replicas, args.scaling_steps = "tiny", "2", 8
    return args


def _scaling(args: argparse.Namespace, wd: Path) -> dict[str, Any]:
    """planaria's kill → back at full width against state size (2 replicas) and replica
    count (the smallest size)."""
    sizes = [s for s in args.scaling_sizes.split(",") if s]
    counts = [int(n) for n in args.scaling_replicas.split(",") if n]
    steps = args.scaling_steps
    kill = steps // 2
    cores = os.cpu_count() or 1

    # Every replica count runs the same workload, in micro-batches small enough that the
    # largest count gives each rank one (48 samples: 8 replicas -> micro-batches of 6).
    micro = min(common.MICRO_BATCH, common.GLOBAL_BATCH // max(counts, default=1))

    def one(size: str, n: int, micro_batch_size: int = common.MICRO_BATCH) -> dict[str, Any]:
        run_dir = wd / f"scaling_{size}_{n}x_mb{micro_batch_size}"  # one run, one directory
        r = run_planaria_kill(steps, kill, size, n, run_dir=run_dir,
                              micro_batch_size=micro_batch_size)
        row = {k: r[k] for k in ("full_width_s", "back_s", "recover_s", "lost_steps",
                                 "replacement_s", "join_s", "transfer_bytes", "transfer_s",
                                 "transfer_gb_per_s", "step_ms_median")}
        row["oversubscribed"] = n > cores
        mb = (row["transfer_bytes"] or 0) / 1e6
        print(f"  {size} x {n} replicas{' (oversubscribed)' if n > cores else ''}: back at "
              f"full width {_fmt(row['full_width_s'])} s (replacement ready "
              f"{_fmt(row['replacement_s'])} s), state {mb:.0f} MB sent at "
              f"{_fmt(row['transfer_gb_per_s'])} GB/s", flush=True)
        return row

    print("recovery against state size (2 replicas) and replica count", flush=True)
    by_size = {size: one(size, 2) for size in sizes}
    by_replicas = {str(n): one(sizes[0], n, micro) for n in counts}
    return {"by_size": by_size, "by_replicas": by_replicas, "replicas_for_sizes": 2,
            "size_for_replicas": sizes[0], "micro_batch_for_replicas": micro, "steps": steps,
            "kill_at_step": kill, "cores": cores}


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _planaria_resumed(run: dict[str, Any]) -> dict[str, Any]:
    """The ``step_resumed`` records of a planaria kill run (lost work per kill)."""
    events = list(read_events(Path(run["run_dir"]) / "events.jsonl").events)
    return {"step_resumed": [e for e in events if e["event"] == "step_resumed"]}


def _repeat(args: argparse.Namespace, rep: int, wd: Path, ft_config: TorchftConfig
            ) -> dict[str, dict[str, Any]]:
    """One repeat, every system, the same seeded victim and kill step."""
    rng = random.Random(args.seed + rep)
    victim, kill_at = rng.randrange(args.replicas), args.kill_at + rng.randrange(3)
    common_fields = {"repeat": rep, "seed": args.seed + rep, "victim": victim,
                     "kill_at_step": kill_at}
    out: dict[str, dict[str, Any]] = {}
    print(f"repeat {rep}: planaria, kill w{victim} at step {kill_at}", flush=True)
    run = run_planaria_kill(args.steps, kill_at, args.size, args.replicas,
                            victim=f"w{victim}", run_dir=wd / f"planaria{rep}")
    out["planaria"] = {**run, **_planaria_resumed(run), "config": {"replicas": args.replicas}}
    print(f"repeat {rep}: torchrun, ckpt every {args.ckpt_every}", flush=True)
    out["torchrun"] = {**runners.run_torchrun_kill(
        args.steps, kill_at, args.size, nproc=args.replicas, ckpt_every=args.ckpt_every,
        timeout_s=args.timeout_s, workdir=wd / f"torchrun{rep}"),
        "config": {"ckpt_every": args.ckpt_every}}
    print(f"repeat {rep}: torchft {ft_config.label()}", flush=True)
    out["torchft"] = {**torchft_runners.run_torchft_kill(
        args.steps, kill_at, args.size, groups=args.replicas, victim=victim,
        restart_delay_s=args.torchft_restart_delay_s, timeout_s=args.timeout_s,
        workdir=wd / f"torchft{rep}", config=ft_config),
        "config": ft_config.as_dict(), "config_applied": sorted(ft_config.as_dict())}
    # torchrun's runner picks the rank it kills itself: no victim of the seed's.
    return {name: {**run, **common_fields, "system": name,
                   **({"victim": None} if name == "torchrun" else {})}
            for name, run in out.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.rescore:
        out = summarize(records.read_raw(Path(args.rescore)))
        print(json.dumps(out), flush=True)
        return out
    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_recovery_"))
    wd.mkdir(parents=True, exist_ok=True)
    raw_root = Path(args.raw_dir) if args.raw_dir else (
        wd / "raw" if args.quick else records.RAW_ROOT)
    commit = records.tree_commit()
    folder = records.raw_dir(raw_root, "recovery", args.size, commit)
    command = shlex.join(["python", "bench/recovery.py", *(sys.argv[1:] if argv is None
                                                           else argv)])
    ft_config = (TorchftConfig.from_dict((lambda d: d.get("config", d))(
        json.loads(Path(args.torchft_config).read_text()))) if args.torchft_config
        else load_best())
    load = {"before": common.loadavg()}
    t0 = time.time()
    this_machine = records.machine()  # the repeats' runs share it
    print(f"{args.replicas} replicas, size={args.size}, kill near step {args.kill_at}, "
          f"{args.repeat} repeats (seeds {args.seed}..), torchft {ft_config.label()}",
          flush=True)
    for i in range(args.repeat):  # interleaved, so every system sees the same machine states
        before = common.loadavg()
        for name, run in _repeat(args, i, wd, ft_config).items():
            records.write_raw(folder, f"{name}-r{i}", {
                **run, "loadavg_before": before, "loadavg_after": common.loadavg(),
                "commit": commit, "command": command, "size": args.size,
                "machine": this_machine})
    raws = records.read_raw(folder)
    paired = summarize(raws)
    pl, tr, ft = paired["planaria"], paired["torchrun"], paired["torchft"]
    # the median run's transfer figures
    pl_median = next((r for r in raws.values() if r["system"] == "planaria"
                      and r.get("back_s") == pl["back_s"]), {})
    transfer = {k: pl_median.get(k) for k in ("transfer_bytes", "transfer_s",
                                              "transfer_gb_per_s", "size")}
    if args.transfer_steps and (transfer["transfer_bytes"] or 0) < MIN_TRANSFER_BYTES:
        kill = max(3, args.transfer_steps // 2)
        print(f"planaria transfer run: size={args.transfer_size}", flush=True)
        transfer = run_planaria_kill(
            args.transfer_steps,
            kill,
            args.transfer_size,
            args.replicas,
            run_dir=wd / "planaria_transfer",
        )
    scaling = None if args.no_scaling else _scaling(args, wd)
    load["after"] = common.loadavg()

    rows = [("planaria", pl), ("torchrun", tr), ("torchft", ft)]
    print()
    print(f"{'system':<10} {'step ms':>8} {'recover_s':>10} {'back_s':>8} {'lost':>5}  notes")
    for name, r in rows:
        if name == "planaria":
            note = (f"detect {_fmt(r.get('detect_s'), '.3f')} s, replacement ready "
                    f"{_fmt(r.get('replacement_s'))} s, join {_fmt(r.get('join_s'))} s, lost "
                    f"work per kill {_fmt(r.get('lost_work_per_kill_steps'), '.3f')} steps")
        elif name == "torchrun":
            note = f"resumed at step {r.get('resume_step')}, phases {json.dumps(r.get('phases_s'))}"
        else:
            note = (f"{ft_config.label()}, failed steps {r.get('failed_steps')}, "
                    f"replacement rejoin {_fmt(r.get('rejoin_s'))} s")
        print(f"{name:<10} {_fmt(r.get('step_ms'), '.0f'):>8} {_fmt(r['recover_s']):>10} "
              f"{_fmt(r['back_s']):>8} {r['lost_steps']:>5}  {note}")
    for peer in ("torchrun", "torchft"):
        print(f"{peer} back_s ÷ planaria's: {_fmt(paired.get(f'speedup_vs_{peer}'))} "
              f"(95 % {paired.get(f'speedup_vs_{peer}_ci95')}; ahead: "
              f"{paired.get(f'speedup_vs_{peer}_ahead')})")
    print(f"state transfer ({transfer['size']}): "
          f"{_fmt((transfer['transfer_bytes'] or 0) / 1e6, '.0f')} MB "
          f"(the survivors waited {_fmt(transfer['transfer_s'], '.3f')} s) at "
          f"{_fmt(transfer['transfer_gb_per_s'])} GB/s")
    print(f"load average before {load['before']} after {load['after']}; "
          f"wall {time.time() - t0:.0f} s")
    out = {
        **paired,
        "planaria": {**pl, "transfer_gb_per_s": transfer["transfer_gb_per_s"],
                     "transfer_bytes": transfer["transfer_bytes"],
                     "transfer_size": transfer["size"]},
        "torchrun": {**tr, "ckpt_every": args.ckpt_every},
        "torchft": {**ft, "config": ft_config.as_dict()},
        "scaling": scaling,
        "size": args.size,
        "replicas": args.replicas,
        "steps": args.steps,
        "kill_at_step": args.kill_at,
        "raw_records": str(folder),
        "loadavg": load,
        "nproc": os.cpu_count(),
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
