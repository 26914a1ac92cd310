"""torchft on the benchmark workload: one replica group = one process.

Each replica group is a separate process started with its own environment (as
torchft's ``train_ddp.py`` example does under torchrun, here without torchrun):

- ``REPLICA_GROUP_ID``: this group's id (0..N-1); a replacement reuses the id
- ``NUM_REPLICA_GROUPS``: N, for the record
- ``TORCHFT_LIGHTHOUSE``: ``http://127.0.0.1:PORT`` of a running ``torchft_lighthouse``
- ``MASTER_ADDR``: where the group's own TCPStore listens, which this script hosts
  (torchrun would otherwise) on a port the OS picks, ``RANK=0``, ``WORLD_SIZE=1``

With ``--standby`` the process is a warm standby: it imports torch and torchft,
builds the model, optimizer and dataset and runs one forward/backward (allocator
and kernels warm), then waits for one line on stdin naming the group id it
replaces (``REPLICA_GROUP_ID`` is then ignored) and only then hosts its store
and joins the lighthouse, as planaria's warm spare joins when it is needed.

Per step: ``start_quorum``; this group's contiguous part of
``bench.common.batch_ids(step)`` split over the *participating* groups, so the
global batch stays the same set of samples whatever the width (like planaria);
gradient accumulation over micro-batches; one allreduce; ``should_commit``
gates the optimizer update. With ``--async-quorum`` (torchft's default) the
quorum runs in the background while this group computes on the width of the
previous quorum; if the quorum changed the width or step, the step's share is
computed again (a replacement heals during its first step without taking part
in it: zero gradient, its received state applied at ``should_commit``).

``--grads`` picks how the gradient is reduced:

- ``bucket`` (the default): the parameters' ``.grad`` are views into one flat
  buffer (as DDP's ``gradient_as_bucket_view``), so backward accumulates straight
  into it and one ``Manager.allreduce(SUM)`` reduces it, no copy either way;
  loss scaled by ``1 / global batch``;
- ``torchft-ddp``: ``torchft.ddp.DistributedDataParallel`` (its comm hook runs
  ``Manager.allreduce`` with torchft's default AVG, i.e. ÷ participants); loss
  scaled by ``participants / global batch``. With torch 2.13 + gloo on CPU its
  comm hook fails an assertion in the survivors when a peer dies mid-allreduce,
  so the fault benches use ``bucket``.

Either way the update equals DDP's and planaria's: the gradient is the sum of
per-sample loss gradients over the global batch ÷ its size, at any width. With
``--prefetch ahead`` (the default, as the DDP baseline and planaria) the next
step's share is loaded while the allreduce is in flight.

Log (JSON lines, ``--out``, shared by the groups): ``{"event": "start", "group",
"pid", "wall", "launched_wall", "standby"}`` once when the group joins; per step
``{"event": "step", "group", "step", "committed", "wall", "step_ms",
"participants", "participating_rank", "manager_step", "loss", "phases_ms"}``
where ``step`` is the step this iteration ran, ``manager_step`` is
``manager.current_step()`` after ``should_commit`` and ``phases_ms`` splits the
step (``quorum``: waiting for it; ``compute``: loading in line and
forward/backward; ``allreduce``; ``commit``: ``should_commit``; ``optim``).
With ``--die-at-step K`` the process SIGKILLs itself once the first iteration at step K or
later has run a third of its median committed step (at most 0.5 s), the point in a step
where planaria's chaos plan lands a kill planned for a step
(``planaria.control.chaos_injection``), after logging ``{"event": "kill", "group", "step",
"wall"}``: the recovery bench kills every system at the same point of a step. With
``--grads-out PATH`` every committed step's reduced flat gradient is saved at
``PATH.format(group=...)`` (tests).
"""

from __future__ import annotations

import time

_LAUNCHED = time.time()  # before importing torch: process start

import argparse  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for bench.common

import torch  # noqa: E402
from ddp_train import JsonLog  # noqa: E402
from torch.distributed import ReduceOp, TCPStore  # noqa: E402
from torchft import Manager, ProcessGroupGloo  # noqa: E402
from torchft.ddp import DistributedDataParallel as TorchftDDP  # noqa: E402

from bench import common  # noqa: E402


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
    p.add_argument("--heartbeat-interval-ms", type=int, default=100,
                   help="how often the manager heartbeats to the lighthouse")
    p.add_argument(
        "--async-quorum",
        action="store_true",
        help="torchft's default: the quorum runs in the background while the group computes, "
        "and a healing group sits out the step it heals in (its state is applied at "
        "should_commit) instead of every group waiting for the heal before the step",
    )
    p.add_argument("--grads", default="bucket", choices=("bucket", "torchft-ddp"))
    p.add_argument("--prefetch", default="ahead", choices=("ahead", "none"))
    p.add_argument("--standby", action="store_true",
                   help="build everything, then wait for the group id on stdin before joining")
    p.add_argument("--grads-out", default=None, help="save each committed step's gradient")
    p.add_argument("--die-at-step", type=int, default=None,
                   help="SIGKILL this process inside this step, a third of a typical step "
                   "in (as planaria's chaos plan lands a kill planned for a step)")
    return p.parse_args(argv)


def bucket_grads(params: list[torch.Tensor]) -> torch.Tensor:
    """One flat buffer; each parameter's ``.grad`` a view into it (backward adds in place)."""
    flat = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        p.grad = flat[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


class Shares:
    """This group's micro-batches of a step at a width, loaded ahead when asked."""

    def __init__(self, dataset, args: argparse.Namespace) -> None:
        self.dataset, self.args = dataset, args
        self._held: tuple[tuple[int, int, int], list] | None = None

    def load(self, step: int, rank: int, world: int) -> list:
        ids = common.split_ids(common.batch_ids(step, self.args.global_batch), rank, world)
        return [common.load_batch(self.dataset, c)
                for c in common.micro_batches(ids, self.args.micro_batch)]

    def take(self, step: int, rank: int, world: int) -> list:
        held, self._held = self._held, None
        if held is not None and held[0] == (step, rank, world):
            return held[1]
        return self.load(step, rank, world)

    def ahead(self, step: int, rank: int, world: int) -> None:
        if self.args.prefetch == "ahead":
            self._held = ((step, rank, world), self.load(step, rank, world))


def warm_up(model: torch.nn.Module, dataset, args: argparse.Namespace) -> None:
    """One forward/backward on a micro-batch (kernels and allocator warm), then no trace."""
    ids = common.batch_ids(0, args.global_batch)[: args.micro_batch]
    common.loss_fn(model, common.load_batch(dataset, ids)).backward()
    for p in model.parameters():
        p.grad = None


def await_group(args: argparse.Namespace) -> int:
    """The group id: from the environment, or (a standby) from one line on stdin."""
    if not args.standby:
        return int(os.environ["REPLICA_GROUP_ID"])
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)  # released without a group: the run is over
    return int(line)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    model = common.make_model(args.size)
    dataset = common.make_dataset(size=args.size)
    if args.standby:
        warm_up(model, dataset, args)
    optimizer = common.make_optimizer(model.parameters())
    params = [p for p in model.parameters() if p.requires_grad]
    flat = bucket_grads(params) if args.grads == "bucket" else None
    shares = Shares(dataset, args)

    group = await_group(args)
    joined = time.time()
    # The group's own store (torchrun would host it; one process per group here), on a
    # port the OS picks now: one picked by the launcher may be taken by the time a slow
    # start or a standby binds it (another group's manager server binds port 0 too).
    store = TCPStore(os.environ["MASTER_ADDR"], 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=args.timeout_s))

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])  # copies in place: the grad views stay
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
        use_async_quorum=args.async_quorum,
        init_sync=False,  # every group seeds the same init
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        store_addr=os.environ["MASTER_ADDR"],
        store_port=store.port,
        heartbeat_interval=timedelta(milliseconds=args.heartbeat_interval_ms),
    )
    net = TorchftDDP(manager, model) if args.grads == "torchft-ddp" else model
    log = JsonLog(args.out)
    log.write(event="start", group=group, pid=os.getpid(), wall=time.time(),
              launched_wall=_LAUNCHED, joined_wall=joined, standby=args.standby, size=args.size)
    saved: list[torch.Tensor] = []

    def compute(step: int, rank: int, world: int) -> float:
        """This group's share of ``step`` at ``world`` participants; its loss sum."""
        scale = (world if flat is None else 1) / args.global_batch
        if flat is not None:
            flat.zero_()
        else:
            optimizer.zero_grad(set_to_none=False)
        chunks, total = shares.take(step, rank, world), 0.0
        for i, batch in enumerate(chunks):
            last = i == len(chunks) - 1
            with net.no_sync() if flat is None and not last else contextlib.nullcontext():
                loss = common.loss_fn(net, batch)
                (loss * scale).backward()
            total += float(loss.detach())
        return total

    first, last_width = None, None
    step_ms: list[float] = []  # committed steps' lengths: a kill lands a third of one in
    try:
        while manager.current_step() < args.steps:
            t0 = time.perf_counter()
            guess = manager.current_step()
            if args.die_at_step is not None and guess >= args.die_at_step:
                # >=: a group's step can jump past one (an async quorum that healed it)
                _die_in(min(0.5, statistics.median(step_ms or [50.0]) / 3000), log, group,
                        guess)
                args.die_at_step = None  # once
            manager.start_quorum()  # waits for the quorum (and heal) unless async
            ts = time.perf_counter()
            loss_sum, done = 0.0, None
            if args.async_quorum and last_width is not None and flat is not None:
                loss_sum, done = compute(guess, *last_width), (guess, *last_width)  # overlaps
            tq = time.perf_counter()
            # participating_rank waits for an async quorum; a group healing under one is
            # not participating (rank None) and contributes a zero gradient to this step.
            rank, world = manager.participating_rank(), manager.num_participants()
            step = manager.current_step()  # after the quorum (and a synchronous heal)
            t1 = time.perf_counter()
            first = step if first is None else first
            if rank is not None and not manager.errored() and done != (step, rank, world):
                loss_sum = compute(step, rank, world)
            last_width = (rank, world) if rank is not None else None
            t2 = time.perf_counter()
            # Fault-tolerant allreduce: on a peer failure the error goes to the manager
            # and should_commit() returns False everywhere.
            if flat is not None:
                work = manager.allreduce(flat, reduce_op=ReduceOp.SUM)
                if rank is not None:
                    shares.ahead(step + 1, rank, world)
                work.wait()
            t3 = time.perf_counter()
            committed = manager.should_commit()
            t4 = time.perf_counter()
            if committed:
                optimizer.step()
                if args.grads_out:
                    saved.append(torch.cat([p.grad.reshape(-1) for p in params]))
            t5 = time.perf_counter()
            ms = (t5 - t0) * 1000
            if committed:
                step_ms.append(ms)
            log.write(
                event="step", group=group, step=step, committed=committed, wall=time.time(),
                step_ms=ms, participants=world, participating_rank=rank,
                manager_step=manager.current_step(), loss=loss_sum,
                warmup=step - first < args.warmup,
                phases_ms={"quorum": (ts - t0 + t1 - tq) * 1000,
                           "compute": (tq - ts + t2 - t1) * 1000,
                           "allreduce": (t3 - t2) * 1000, "commit": (t4 - t3) * 1000,
                           "optim": (t5 - t4) * 1000},
            )
    finally:
        if args.grads_out:
            torch.save(saved, args.grads_out.format(group=group))
        manager.shutdown(wait=False)


def _die_in(seconds: float, log: JsonLog, group: int, step: int) -> None:
    """SIGKILLs this process ``seconds`` from now, logging the time just before."""

    def die() -> None:
        log.write(event="kill", group=group, step=step, wall=time.time())
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Timer(seconds, die).start()


if __name__ == "__main__":
    main()
