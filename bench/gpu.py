"""planaria on a GPU: fault-free step time against DDP, and recovery from a kill.

    python bench/gpu.py              # on a machine with a CUDA device (bench/gpu_check.sh)
    python bench/gpu.py --quick      # smoke run

The same model, data and global batch as ``bench/overhead.py`` and
``bench/recovery.py``, on the GPU. With a GPU per rank both planaria and DDP use
NCCL; with fewer GPUs than ranks the ranks share the devices and both use gloo,
which reduces CUDA tensors through host memory (NCCL cannot put two ranks on one
device), so the comparison stays like for like.

Figures:

- ``overhead``: per size, planaria's step period on its autonomous loop (``fit``'s:
  ``Job.run_steps``, the workers running up to the next boundary without a controller
  round trip per step; the periods between rank 0's commits) and DDP's (rank 0's step
  under ``torchrun``, loading the next batch ahead as planaria does), each a median over
  the steady steps of a round, rounds interleaved; the ratio is the median of the
  per-round ratios with the paired bootstrap interval (``bench.stats.paired_ratio``), the
  estimator of ``bench/overhead.py``. Target (issue 31): <= 1.05. ``--train-step`` adds
  planaria's one-step-at-a-time driver (``Job.train_step``: a controller round trip per
  step), which is what this bench measured before 2026-12-04;
- ``recovery``: a worker SIGKILLed mid-run (resize policy, then a hot-join): the
  time to the next committed step, back beyond the last step committed before the
  kill, lost steps, detection, the replacement's start and its state transfer
  (bytes and GB/s, staged between the GPU and the wire).

The last line printed is one JSON object (``"bench": "gpu"``).
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

import torch  # noqa: E402

from bench import common, stats  # noqa: E402
from bench.baselines.runners import run_ddp_steady  # noqa: E402
from bench.planaria_side import run_planaria_kill, run_planaria_steady  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="small,large", help="model sizes for the overhead runs")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="interleaved planaria/DDP pairs")
    p.add_argument("--train-step", action="store_true",
                   help="also planaria one step at a time (Job.train_step), beside each round")
    p.add_argument("--recovery-size", default="large", choices=sorted(common.SIZES))
    p.add_argument("--recovery-steps", type=int, default=30)
    p.add_argument("--kill-at", type=int, default=15)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, few steps")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.warmup, args.rounds = "tiny", 10, 3, 1
        args.recovery_size, args.recovery_steps, args.kill_at = "tiny", 14, 5
    return args


def placement(replicas: int) -> tuple[dict[str, Any], str]:
    """planaria's RunConfig options and DDP's backend: a GPU per rank with NCCL where there
    are enough (one more for the replacement), else shared GPUs over gloo."""
    gpus = torch.cuda.device_count()
    if gpus >= replicas + 1:
        return {"use_gpu": True}, "nccl"
    share = min(1.0, gpus / (replicas + 1))
    return {"use_gpu": True, "gpus_per_worker": share, "backend": "gloo"}, "gloo"


def overhead(args: argparse.Namespace, size: str, wd: Path) -> dict[str, Any]:
    options, backend = placement(args.replicas)
    rounds: dict[str, list[float]] = {"planaria": [], "ddp": [], "train_step": []}
    for i in range(args.rounds):
        pl = run_planaria_steady(args.steps, size, args.replicas, 1, warmup=args.warmup,
                                 run_dir=wd / f"planaria_{size}_{i}", driver="run_steps",
                                 **options)
        ddp = run_ddp_steady(args.steps, size, args.replicas, 1, warmup=args.warmup,
                             timeout_s=args.timeout_s, workdir=wd / f"ddp_{size}_{i}",
                             device="cuda", backend=backend)
        rounds["planaria"].append(pl["step_ms_median"])
        rounds["ddp"].append(ddp["step_ms_median"])
        line = (f"  {size} round {i}: planaria {pl['step_ms_median']:.2f} ms, "
                f"DDP {ddp['step_ms_median']:.2f} ms ({backend})")
        if args.train_step:
            one = run_planaria_steady(args.steps, size, args.replicas, 1, warmup=args.warmup,
                                      run_dir=wd / f"planaria_{size}_{i}_ts", **options)
            rounds["train_step"].append(one["step_ms_median"])
            line += f"; planaria one step at a time {one['step_ms_median']:.2f} ms"
        print(line, flush=True)
    ratio = stats.paired_ratio(rounds["planaria"], rounds["ddp"])
    out = {"planaria_step_ms": statistics.median(rounds["planaria"]),
           "ddp_step_ms": statistics.median(rounds["ddp"]), "ratio": ratio.median,
           "ratio_ci95": ratio.ci95, "rounds": rounds["planaria"], "ddp_rounds": rounds["ddp"],
           "driver": "run_steps", "backend": backend,
           "le_1_05": stats.met(ratio, 1.05, "<=")}
    if rounds["train_step"]:
        out["train_step_ms"] = statistics.median(rounds["train_step"])
        out["train_step_ratio"] = stats.paired_ratio(rounds["train_step"], rounds["ddp"]).median
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA device: none is visible here")
    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    wd.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    device = torch.cuda.get_device_name(0)
    print(f"gpu: {torch.cuda.device_count()} x {device}, torch {torch.__version__}", flush=True)
    over = {size: overhead(args, size, wd) for size in args.sizes.split(",")}
    options, backend = placement(3)
    rec = run_planaria_kill(args.recovery_steps, args.kill_at, args.recovery_size, 3, 1,
                            run_dir=wd / "kill", **options)
    print()
    for size, o in over.items():
        ci = o["ratio_ci95"] or (float("nan"), float("nan"))
        print(f"{size:<6} planaria {o['planaria_step_ms']:8.2f} ms  DDP {o['ddp_step_ms']:8.2f} ms"
              f"  ratio {o['ratio']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]  ({o['backend']}, "
              "autonomous loop)")
    print(f"recovery ({args.recovery_size}, 3 replicas, {backend}): next step "
          f"{rec['recover_s']:.2f} s after the kill, back beyond it {rec['back_s']:.2f} s, "
          f"lost steps {rec['lost_steps']}, transfer {rec['transfer_bytes']} B at "
          f"{rec['transfer_gb_per_s']} GB/s; wall {time.time() - t0:.0f} s")
    keys = ("recover_s", "back_s", "lost_steps", "detect_s", "replacement_s", "join_s",
            "transfer_bytes", "transfer_s", "transfer_gb_per_s", "step_ms_median",
            "final_width")
    out = {
        "bench": "gpu",
        "device": device,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "overhead": over,
        "recovery": {"size": args.recovery_size, "backend": backend,
                     **{k: rec.get(k) for k in keys}},
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
