"""torchft 0.2.0 on the benchmark workload: one replica group = one process.

Each replica group is a separate process started with its own environment (as
torchft's ``train_ddp.py`` example does under torchrun, here without torchrun):

- ``REPLICA_GROUP_ID``: this group's id (0..N-1); a replacement reuses the id
- ``NUM_REPLICA_GROUPS``: N, for the record
- ``TORCHFT_LIGHTHOUSE``: ``http://127.0.0.1:PORT`` of a running ``torchft_lighthouse``
- ``MASTER_ADDR`` / ``MASTER_PORT``: the group's own TCPStore, which this script
  hosts (torchrun would otherwise), ``RANK=0``, ``WORLD_SIZE=1``

Per step: ``start_quorum`` (synchronous, so a replacement heals from a peer
before its first step and then participates), then this group's contiguous
part of ``bench.common.batch_ids(step)`` split over the *participating* groups,
so the global batch stays the same set of samples whatever the width (like
planaria); gradient accumulation over micro-batches; one allreduce of a flat
gradient buffer; ``should_commit`` gates the optimizer update. With
``--async-quorum`` (torchft's default) the quorum runs in the background and a
replacement heals during its first step without taking part in it (zero
gradient; its received state is applied at ``should_commit``); the split over
the participating groups still needs the quorum's width, so the step waits for
the quorum before loading its samples.

Gradients go through ``Manager.allreduce`` on a flat buffer, not through
torchft's DistributedDataParallel wrapper: with torch 2.13 + gloo on CPU, that
wrapper's comm hook fails an assertion in the survivors when a peer dies
mid-allreduce, instead of reporting the error to the manager. The buffer holds
``sum of per-sample loss gradients ÷ global batch``, reduced with SUM, so the
update equals DDP's and planaria's.

Log (JSON lines, ``--out``, shared by the groups): ``{"event": "start", "group",
"pid", "wall"}`` once; per step ``{"event": "step", "group", "step", "committed",
"wall", "step_ms", "participants", "participating_rank", "manager_step",
"loss"}`` where ``step`` is the step this iteration ran and ``manager_step`` is
``manager.current_step()`` after ``should_commit``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for bench.common

import torch
from ddp_train import JsonLog
from torch.distributed import ReduceOp, TCPStore
from torchft import Manager, ProcessGroupGloo

from bench import common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--size", default="small", choices=sorted(common.SIZES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=common.GLOBAL_BATCH)
    p.add_argument("--micro-batch", type=int, default=common.MICRO_BATCH)
    p.add_argument("--out", default=None)
    p.add_argument("--pg-timeout-s", type=float, default=10.0, help="gloo collective timeout")
    p.add_argument("--timeout-s", type=float, default=30.0, help="manager op / quorum timeout")
    p.add_argument(
        "--async-quorum",
        action="store_true",
        help="torchft's default: the quorum runs in the background and a healing group sits "
        "out the step it heals in (its state is applied at should_commit) instead of every "
        "group waiting for the heal before the step",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    group = int(os.environ["REPLICA_GROUP_ID"])
    log = JsonLog(args.out)

    # The group's own store (torchrun would host it; one process per group here).
    store = TCPStore(  # noqa: F841  (kept alive for the Manager)
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=args.timeout_s),
    )

    model = common.make_model(args.size)
    optimizer = common.make_optimizer(model.parameters())
    dataset = common.make_dataset(size=args.size)
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.zeros(sum(p.numel() for p in params))

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    timeout = timedelta(seconds=args.timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{group}",
        # Default (synchronous): heal before the step, then participate in it.
        use_async_quorum=args.async_quorum,
        init_sync=False,  # every group seeds the same init
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
    )
    log.write(event="start", group=group, pid=os.getpid(), wall=time.time(), size=args.size)

    first = None
    try:
        while manager.current_step() < args.steps:
            t0 = time.perf_counter()
            manager.start_quorum()
            # participating_rank waits for an async quorum; a group healing under one is
            # not participating (rank None) and contributes a zero gradient to this step.
            rank, world = manager.participating_rank(), manager.num_participants()
            step = manager.current_step()  # after the quorum (and a synchronous heal)
            first = step if first is None else first
            flat.zero_()
            loss_sum = 0.0
            if rank is not None and not manager.errored():
                ids = common.split_ids(common.batch_ids(step, args.global_batch), rank, world)
                for p in params:
                    p.grad = None
                for chunk in common.micro_batches(ids, args.micro_batch):
                    loss = common.loss_fn(model, common.load_batch(dataset, chunk))
                    (loss / args.global_batch).backward()
                    loss_sum += float(loss.detach())
                torch.cat([p.grad.reshape(-1) for p in params], out=flat)
            # Fault-tolerant allreduce: on a peer failure the error goes to the manager
            # and should_commit() returns False everywhere.
            manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
            committed = manager.should_commit()
            if committed:
                offset = 0
                for p in params:
                    n = p.numel()
                    p.grad = flat[offset : offset + n].view_as(p).clone()
                    offset += n
                optimizer.step()
            log.write(
                event="step",
                group=group,
                step=step,
                committed=committed,
                wall=time.time(),
                step_ms=(time.perf_counter() - t0) * 1000,
                participants=world,
                participating_rank=rank,
                manager_step=manager.current_step(),
                loss=loss_sum,
                warmup=step - first < args.warmup,
            )
    finally:
        manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
