"""Plain DDP on the benchmark workload under NVIDIA's resiliency extension (``ft_launcher``).

The same step as ``ddp_train.py`` (its setup, loader and ``train_step``: same model,
samples, global batch and prefetch), plus what NVRx's fault tolerance asks of a workload:
a ``RankMonitorClient`` that heartbeats to the launcher's rank monitor once per step, so a
hung or dead rank is detected and the launcher restarts the workers. Rank 0 logs like
``ddp_train.py`` (``start`` records from every rank, one ``step`` record per step).

    ft_launcher --nproc-per-node=2 bench/baselines/nvrx_train.py --steps 30 --out nvrx.jsonl
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for bench.common

import torch.distributed as dist
from ddp_train import (
    JsonLog,
    StepLoader,
    end_after_the_group,
    load_ahead_hook,
    make_parser,
    setup,
    start_record,
    train_step,
)
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    model, optimizer, dataset = setup(args)
    monitor = RankMonitorClient()
    monitor.init_workload_monitoring()
    loader = StepLoader(dataset, args)
    if loader.mode == "ahead":
        model.register_comm_hook(loader, load_ahead_hook)
    rank = dist.get_rank()
    log = JsonLog(args.out)
    log.write(**start_record(args, prefetch=args.prefetch, launcher="ft_launcher"))
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, dataset, step, args, loader)
        monitor.send_heartbeat()
        if rank == 0:
            log.write(event="step", step=step, wall=time.time(),
                      step_ms=(time.perf_counter() - t0) * 1000, loss=loss,
                      warmup=step < args.warmup)
    dist.barrier()
    monitor.shutdown_workload_monitoring()
    end_after_the_group()


if __name__ == "__main__":
    main()
