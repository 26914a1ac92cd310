"""Recovery from one SIGKILL, three ways, in one run: planaria, torchrun + checkpoints, torchft.

    python bench/recovery.py                  # 3 replicas, "small" model, kill at step 30 of 60
    python bench/recovery.py --quick          # smoke run: tiny model, few steps

Every system trains the same workload (``bench.common``) on 3 replicas with 1
torch thread each, and one worker is SIGKILLed once the job reached step
``--kill-at``:

- planaria: resize policy, the kill sent by planaria's own chaos plan
  (``kill:w1@stepK``); the survivors go on at width 2 and a replacement joins
  live, receiving the state from a survivor. Figures from ``events.jsonl``.
- torchrun: DDP with a checkpoint every ``--ckpt-every`` steps under
  ``torchrun --max-restarts``; every worker restarts and resumes from the
  checkpoint (``bench.baselines.runners.run_torchrun_kill``).
- torchft: one replica group per process and a lighthouse; survivors go on,
  a replacement heals from a peer (``run_torchft_kill``).

The same definitions for all three (see ``bench/baselines/runners.py``):
``recover_s`` = kill → next committed step; ``back_s`` = kill → first commit of
a step beyond the highest step committed before the kill; ``lost_steps`` =
steps committed twice. For planaria also ``join_s`` (replacement ready → first
committed step that includes it, from the ``joined`` event) and the state
transfer throughput (``state_transfer`` event: bytes ÷ seconds, the seconds
covering the layout request and the send/receive). The transfer figure needs
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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from bench import common  # noqa: E402
from bench.baselines.runners import run_torchft_kill, run_torchrun_kill  # noqa: E402
from bench.planaria_side import run_planaria_kill  # noqa: E402

MIN_TRANSFER_BYTES = 100 * 10**6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="medium", choices=sorted(common.SIZES))
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at", type=int, default=30, help="SIGKILL once this step runs")
    p.add_argument("--ckpt-every", type=int, default=20, help="torchrun's checkpoint interval")
    p.add_argument(
        "--repeat", type=int, default=3, help="kill runs per system; the median run is reported"
    )
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


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose back_s is the median of the repeats (its other figures stay its own)."""
    done = sorted((r for r in runs if r.get("back_s") is not None), key=lambda r: r["back_s"])
    chosen = dict(done[(len(done) - 1) // 2] if done else runs[0])
    chosen["back_s_all"] = [r.get("back_s") for r in runs]
    return chosen


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_recovery_"))
    wd.mkdir(parents=True, exist_ok=True)
    load = {"before": common.loadavg()}
    t0 = time.time()

    print(
        f"planaria: {args.replicas} replicas, size={args.size}, kill w1 at step {args.kill_at}",
        flush=True,
    )
    runs: dict[str, list[dict[str, Any]]] = {"planaria": [], "torchrun": [], "torchft": []}
    for i in range(args.repeat):  # interleaved, so every system sees the same machine states
        runs["planaria"].append(
            run_planaria_kill(
                args.steps, args.kill_at, args.size, args.replicas, run_dir=wd / f"planaria{i}"
            )
        )
        print(f"torchrun: ckpt every {args.ckpt_every}", flush=True)
        runs["torchrun"].append(
            run_torchrun_kill(
                args.steps,
                args.kill_at,
                args.size,
                nproc=args.replicas,
                ckpt_every=args.ckpt_every,
                timeout_s=args.timeout_s,
                workdir=wd / f"torchrun{i}",
            )
        )
        print("torchft", flush=True)
        runs["torchft"].append(
            run_torchft_kill(
                args.steps,
                args.kill_at,
                args.size,
                groups=args.replicas,
                restart_delay_s=args.torchft_restart_delay_s,
                timeout_s=args.timeout_s,
                workdir=wd / f"torchft{i}",
            )
        )
    pl, tr, ft = (_median_run(runs[name]) for name in ("planaria", "torchrun", "torchft"))
    transfer = pl
    if args.transfer_steps and (pl["transfer_bytes"] or 0) < MIN_TRANSFER_BYTES:
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
            note = (
                f"detect {_fmt(r['detect_s'], '.3f')} s, replacement ready "
                f"{_fmt(r['replacement_s'])} s, join {_fmt(r['join_s'])} s"
            )
        elif name == "torchrun":
            note = f"resumed at step {r.get('resume_step')}, phases {json.dumps(r.get('phases_s'))}"
        else:
            note = (
                f"failed steps {r.get('failed_steps')}, "
                f"replacement rejoin {_fmt(r.get('rejoin_s'))} s"
            )
        print(
            f"{name:<10} {_fmt(r.get('step_ms_median'), '.0f'):>8} {_fmt(r['recover_s']):>10} "
            f"{_fmt(r['back_s']):>8} {r['lost_steps']:>5}  {note}"
        )
    print(
        f"state transfer ({transfer['size']}): "
        f"{_fmt((transfer['transfer_bytes'] or 0) / 1e6, '.0f')} MB "
        f"in {_fmt(transfer['transfer_s'], '.3f')} s = {_fmt(transfer['transfer_gb_per_s'])} GB/s"
    )
    print(
        f"load average before {load['before']} after {load['after']}; wall {time.time() - t0:.0f} s"
    )

    def speedup(other: dict[str, Any]) -> float | None:
        if other["back_s"] is None or not pl["back_s"]:
            return None
        return other["back_s"] / pl["back_s"]

    keep = ("recover_s", "back_s", "lost_steps")
    out = {
        "bench": "recovery",
        "planaria": {
            **{k: pl[k] for k in keep},
            "join_s": pl["join_s"],
            "transfer_gb_per_s": transfer["transfer_gb_per_s"],
            "transfer_bytes": transfer["transfer_bytes"],
            "transfer_size": transfer["size"],
            "detect_s": pl["detect_s"],
            "replacement_s": pl["replacement_s"],
            "step_ms": pl["step_ms_median"],
            "back_s_all": pl["back_s_all"],
        },
        "torchrun": {
            **{k: tr[k] for k in keep},
            "step_ms": tr["step_ms_median"],
            "back_s_all": tr["back_s_all"],
            "ckpt_every": args.ckpt_every,
            "phases_s": tr.get("phases_s"),
        },
        "torchft": {
            **{k: ft[k] for k in keep},
            "back_s_all": ft["back_s_all"],
            "step_ms": ft["step_ms_median"],
            "rejoin_s": ft.get("rejoin_s"),
        },
        "speedup_vs_torchrun": speedup(tr),
        "speedup_vs_torchft": speedup(ft),
        "scaling": scaling,
        "size": args.size,
        "replicas": args.replicas,
        "steps": args.steps,
        "repeat": args.repeat,
        "kill_at_step": args.kill_at,
        "loadavg": load,
        "nproc": os.cpu_count(),
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
