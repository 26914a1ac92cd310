"""Plain PyTorch DDP on the benchmark workload, for ``torchrun --nproc_per_node=N``.

Each step, every rank takes its contiguous part of ``bench.common.batch_ids(step)``
and runs it in micro-batches; all but the last backward run under ``no_sync``, so
one allreduce per step carries the gradient, which equals "sum of per-sample
loss gradients over the global batch ÷ global batch size", as in planaria.

Rank 0 appends one JSON line per step to ``--out``:
``{"event": "step", "step", "wall", "step_ms", "loss", "warmup"}``
(``wall`` is ``time.time()`` at the end of the step; ``warmup`` marks the first
``--warmup`` steps, which a report should leave out). Every rank appends a
``{"event": "start", "rank", "pid", "wall", "launched_wall", "imported_wall",
"pg_wall", ...}`` line when it starts (process start, torch imported, process
group ready).

``--prefetch`` gives DDP the loading planaria's worker has, so that a comparison
measures the rest of the step: ``ahead`` (the default, planaria's where no core is
spare) loads this rank's share of the next step while the step's last gradient
bucket is in flight (a comm hook: the default all-reduce, then the load, as
planaria's worker loads ahead between launching its reduction and waiting on it);
``thread`` loads the next step on a background thread while this one runs
(planaria's ``prefetch`` where a core is spare); ``none`` loads each micro-batch in
line.

    torchrun --nproc_per_node=2 bench/baselines/ddp_train.py --steps 30 --out ddp.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

_LAUNCHED = time.time()  # before importing torch: process start, for restart timings
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for bench.common

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from bench import common  # noqa: E402


class JsonLog:
    """Append-only JSON-lines file, one flushed line per record."""

    def __init__(self, path: str | None) -> None:
        self._f = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115

    def write(self, **record) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._f.flush()


def make_parser(**defaults) -> argparse.ArgumentParser:
    """The options every DDP baseline script takes (``defaults`` override defaults)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="steps to train (global step count)")
    p.add_argument("--size", default="small", choices=sorted(common.SIZES))
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--warmup", type=int, default=3, help="first steps marked as warm-up")
    p.add_argument("--global-batch", type=int, default=common.GLOBAL_BATCH)
    p.add_argument("--micro-batch", type=int, default=common.MICRO_BATCH)
    p.add_argument("--out", default=None, help="JSON-lines log (rank 0 steps, every rank's start)")
    p.add_argument("--pg-timeout-s", type=float, default=60.0, help="collective timeout")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the model trains (cuda: the rank's GPU, or a shared one)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                   help="process group backend (nccl needs a GPU per rank)")
    p.add_argument("--prefetch", default="ahead", choices=PREFETCH,
                   help="how the next step's samples load (see the module doc)")
    p.set_defaults(**defaults)
    return p


PREFETCH = ("ahead", "thread", "none")


class StepLoader:
    """This rank's micro-batches of a step, loaded as ``--prefetch`` says (module doc)."""

    def __init__(self, dataset, args: argparse.Namespace) -> None:
        self.dataset, self.args = dataset, args
        self.mode = getattr(args, "prefetch", "none")
        self._held: tuple[int, Future] | None = None
        self._pool = ThreadPoolExecutor(1) if self.mode == "thread" else None
        self.pending: Callable[[], None] | None = None  # the comm hook's load, if armed

    def load(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        args = self.args
        rank, world = dist.get_rank(), dist.get_world_size()
        ids = common.split_ids(common.batch_ids(step, args.global_batch), rank, world)
        chunks = common.micro_batches(ids, args.micro_batch)
        if not chunks:
            raise ValueError(f"rank {rank} got no samples: global batch < world size")
        return [tuple(t.to(args.device, non_blocking=True)
                      for t in common.load_batch(self.dataset, chunk)) for chunk in chunks]

    def take(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        held, self._held = self._held, None
        if held is not None and held[0] == step:
            return held[1].result()
        return self.load(step)

    def ahead(self, step: int) -> None:
        """Starts loading step ``step`` (the next one) as the mode says."""
        if self.mode == "thread":
            assert self._pool is not None
            self._held = (step, self._pool.submit(self.load, step))
        elif self.mode == "ahead":
            def load_now() -> None:
                future: Future = Future()
                future.set_result(self.load(step))
                self._held = (step, future)
            self.pending = load_now


def load_ahead_hook(loader: StepLoader, bucket):  # DDP reads a real annotation: none
    """DDP's default all-reduce of a bucket (the mean over ranks); on the step's last
    bucket, the next step's load runs while it is in flight."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    fut = dist.all_reduce(buf, async_op=True).get_future()
    if bucket.is_last() and loader.pending is not None:
        pending, loader.pending = loader.pending, None
        pending()
    return fut.then(lambda f: f.value()[0])


def setup(args: argparse.Namespace):
    """Process group, model (DDP), optimizer and dataset; the same on every rank."""
    torch.set_num_threads(args.threads)
    args.imported_wall = time.time()
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local % torch.cuda.device_count())  # ranks share GPUs if few
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.pg_timeout_s))
    args.pg_wall = time.time()
    model = DDP(common.make_model(args.size).to(args.device))
    optimizer = common.make_optimizer(model.parameters())
    dataset = common.make_dataset(size=args.size)
    return model, optimizer, dataset


def train_step(model: DDP, optimizer, dataset, step: int, args: argparse.Namespace,
               loader: StepLoader | None = None) -> float:
    """One optimizer step on this rank's part of step ``step``'s global batch; its loss sum.
    With a ``loader`` (its comm hook registered for ``ahead``), the next step loads as its
    mode says; without one, the step loads in line."""
    world = dist.get_world_size()
    if loader is None:
        loader = StepLoader(dataset, argparse.Namespace(**{**vars(args), "prefetch": "none"}))
    chunks = loader.take(step)
    if step + 1 < args.steps:
        loader.ahead(step + 1)
    # DDP averages over ranks: scale by world / global batch to get sum / global batch.
    scale = world / args.global_batch
    optimizer.zero_grad(set_to_none=False)
    total = 0.0
    for i, batch in enumerate(chunks):
        if i < len(chunks) - 1:
            with model.no_sync():
                loss = common.loss_fn(model, batch)
                (loss * scale).backward()
        else:
            loss = common.loss_fn(model, batch)
            (loss * scale).backward()  # the one allreduce of the step
        total += float(loss.detach())
    optimizer.step()
    if args.device == "cuda":
        torch.cuda.synchronize()  # the step's time includes its GPU work
    return total


def start_record(args: argparse.Namespace, **extra) -> dict:
    return {
        "event": "start",
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "pid": os.getpid(),
        "wall": time.time(),
        "launched_wall": _LAUNCHED,
        "imported_wall": getattr(args, "imported_wall", None),
        "pg_wall": getattr(args, "pg_wall", None),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "size": args.size,
        **extra,
    }


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    model, optimizer, dataset = setup(args)
    loader = StepLoader(dataset, args)
    if loader.mode == "ahead":
        model.register_comm_hook(loader, load_ahead_hook)
    rank = dist.get_rank()
    log = JsonLog(args.out)
    log.write(**start_record(args, prefetch=args.prefetch))
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, dataset, step, args, loader)
        step_ms = (time.perf_counter() - t0) * 1000
        if rank == 0:
            log.write(
                event="step",
                step=step,
                wall=time.time(),
                step_ms=step_ms,
                loss=loss,
                warmup=step < args.warmup,
            )
    dist.barrier()
    end_after_the_group()


def end_after_the_group() -> None:
    """Ends a worker whose steps are all done and logged. gloo's threads can abort the
    interpreter's teardown ("terminate called without an active exception", SIGABRT) after
    ``destroy_process_group``; that would fail a finished run, so the process ends at once."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
