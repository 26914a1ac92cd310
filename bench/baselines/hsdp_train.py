"""Plain FSDP2 HSDP on ``planaria.examples.tiny_gpt``, for ``torchrun --nproc_per_node=R*S``.

The baseline of ``bench/sharded.py``: what planaria's sharded replicas
(``RunConfig(workers_per_replica=S)``, R replicas) do, written with torch alone. A
2-D device mesh ``(replicate, shard) = (R, S)`` (gloo), the same per-layer
``fully_shard`` units as planaria's :func:`planaria.worker.sharded.default_shard` (each
transformer block a unit, the root takes the rest) applied with that mesh (HSDP:
sharded over ``shard``, replicated over ``replicate``), the same model, dataset,
AdamW, warm-up schedule and gradient clipping (``tiny_gpt.make_spec``'s; the model
built under the same seeds as planaria's workers build it), and the
same samples per step and per rank as planaria gives its workers: the global batch
of step s is ``planaria.data.plan.DataPlan(len(dataset), G, seed).batch(s)``, each
replica takes its whole micro-batches (``micro_batch_range`` over the replicas),
and each rank of the replica its whole micro-batches of those (over the shards).

Each rank runs its micro-batches with gradient accumulation, as planaria's workers
do: every micro-batch's backward reduce-scatters its gradient inside the replica,
and the last one's also all-reduces the shards across the replicas
(``set_requires_all_reduce``; ``--sync every`` all-reduces every micro-batch,
``--sync last`` defers the reduce-scatter too, like DDP's ``no_sync``). The loss of
a micro-batch of n samples is scaled by n / G and FSDP's reductions sum (divide
factor 1), so the gradient is "sum over the global batch / G" as in planaria. A
rank with fewer micro-batches than another of its replica pads with a weightless
one (FSDP's collectives pair them), as planaria's do. Then clipping
(``clip_grad_norm_`` on the sharded gradients), ``optimizer.step()``, the
schedule's step, ``zero_grad``. It trains what planaria trains: with
``--global-loss`` its loss per step equals planaria's 2 x 2 run's to ~1e-7
(``bench/sharded.py --loss-check``).

Rank 0 appends one JSON line per step to ``--out``:
``{"event": "step", "step", "wall", "step_ms", "loss", "warmup"}`` (``step_ms``:
data, forward/backward, reductions, clipping and the update of that step; ``loss``:
rank 0's own loss sum, or with ``--global-loss`` the global batch's mean, all-reduced
after the timer, to compare with planaria's), and every rank a ``start`` line (as
``ddp_train.py``).

    torchrun --nproc_per_node=4 bench/baselines/hsdp_train.py --replicas 2 --shards 2 \\
        --steps 30 --out hsdp.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

_LAUNCHED = time.time()  # before importing torch: process start
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for bench.*

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.baselines.ddp_train import JsonLog, end_after_the_group, start_record  # noqa: E402


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="first steps marked as warm-up")
    p.add_argument("--replicas", type=int, default=2, help="mesh dim 'replicate'")
    p.add_argument("--shards", type=int, default=2, help="mesh dim 'shard'")
    p.add_argument("--dim", type=int, default=128, help="tiny_gpt width")
    p.add_argument("--layers", type=int, default=4, help="tiny_gpt blocks")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--sync", default="step", choices=("step", "every", "last"),
                   help="step: reduce-scatter every micro-batch, all-reduce across replicas "
                        "once a step (planaria's pattern); every: both every micro-batch; "
                        "last: both only on the last micro-batch")
    p.add_argument("--out", default=None, help="JSON-lines log (rank 0 steps, every rank's start)")
    p.add_argument("--global-loss", action="store_true",
                   help="log the step's mean loss over the global batch (an all-reduce after "
                        "the step's timer: for checking against planaria's, not for timing)")
    p.add_argument("--pg-timeout-s", type=float, default=120.0)
    return p


def _share(
    num_micro: int, replicas: int, shards: int, rep: int, shard: int
) -> tuple[int, int, int]:
    """(first, count, rounds): this rank's micro-batches, as planaria's workers split them,
    and the forwards every rank of the replica makes (the most any of them runs)."""
    from planaria.data.plan import micro_batch_range

    rep_first, rep_count = micro_batch_range(num_micro, replicas, rep)
    sub, own = micro_batch_range(rep_count, shards, shard)
    return rep_first + sub, own, -(-rep_count // shards)


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from planaria.data.plan import DataPlan
    from planaria.data.randomness import factory_seed, seed_globals
    from planaria.examples import tiny_gpt
    from planaria.worker.sharded import default_shard

    args.imported_wall = time.time()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout_s))
    if dist.get_world_size() != args.replicas * args.shards:
        raise SystemExit(f"world size {dist.get_world_size()} != --replicas x --shards")
    mesh = init_device_mesh("cpu", (args.replicas, args.shards),
                            mesh_dim_names=("replicate", "shard"))
    args.pg_wall = time.time()
    rep, shard = mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")

    spec = tiny_gpt.make_spec(dim=args.dim, layers=args.layers,
                              global_batch_size=args.global_batch,
                              micro_batch_size=args.micro_batch)
    seed_globals(factory_seed(spec.seed, "model"))  # as planaria's workers build it
    model = default_shard(spec.model(), mesh)
    assert isinstance(model, FSDPModule)
    for module in model.modules():  # sum (planaria divides by the global batch itself)
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    optimizer = spec.optimizer(model.parameters())
    scheduler = spec.lr_scheduler(optimizer) if spec.lr_scheduler is not None else None
    dataset = spec.dataset()
    plan = DataPlan(len(dataset), spec.global_batch_size, spec.seed)
    mbs, gbs = spec.micro_batch_size, spec.global_batch_size
    first, count, rounds = _share(gbs // mbs, args.replicas, args.shards, rep, shard)

    log = JsonLog(args.out)
    args.size = f"tiny_gpt-{args.dim}x{args.layers}"
    log.write(**start_record(args, replica=rep, shard=shard, micro_batches=count))
    rank = dist.get_rank()
    for step in range(args.steps):
        t0 = time.perf_counter()
        ids = plan.batch(step)[first * mbs : (first + count) * mbs]
        batches = [(len(chunk), torch.stack([dataset[int(i)] for i in chunk]))
                   for chunk in (ids[j : j + mbs] for j in range(0, len(ids), mbs))]
        batches += [(0, batches[0][1])] * (rounds - len(batches))  # weightless padding
        model.train()
        total = 0.0
        for j, (n, batch) in enumerate(batches):
            last = j == len(batches) - 1
            if args.sync == "step":
                model.set_requires_all_reduce(last)
            elif args.sync == "last":
                model.set_requires_gradient_sync(last)
            out = spec.loss(model, batch)
            loss = out[0] if isinstance(out, tuple) else out
            (loss * (n / gbs)).backward()
            total += float(loss.detach()) * n
        if spec.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_ms = (time.perf_counter() - t0) * 1000
        if args.global_loss:
            summed = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(summed)
            total = float(summed) / gbs
        if rank == 0:
            log.write(event="step", step=step, wall=time.time(), step_ms=step_ms, loss=total,
                      warmup=step < args.warmup, pid=os.getpid())
    dist.barrier()
    end_after_the_group()


if __name__ == "__main__":
    main()
