"""DCP ``async_save`` as a torchrun job runs it: N worker processes in a gloo group, each a
DDP rank training the shared workload (``bench.common``) and each saving its part.

Every rank holds the whole replicated state (DDP); ``torch.distributed.checkpoint``'s default
planner writes each replicated tensor from one rank only, spread over the ranks, so each
process writes about 1/N of the bytes, as each planaria worker writes its byte-balanced share.
The ranks are ``torch.multiprocessing`` (spawn) processes driven by the bench through queues,
so that runs of this group and of planaria's job interleave in one bench process.

A run is ``steps`` training steps with an ``async_save`` every ``every`` steps (``every=0``:
none). Per save a rank records the time its step loop was blocked: the ``async_save`` call
itself, the wait for the previous save's upload when it has not finished by the next save
(torchtitan's order), and, with staging in the background, the wait for the staging to finish
before the next optimizer step changes the state. At the run's end every rank waits for its
last upload (part of the run's wall). The bench reads the slowest rank (a DDP step is as slow
as its slowest rank).

DCP's options swept (:data:`SWEEP`; CPU-only here, so no pinned memory and no non-blocking
copies, which need an accelerator):

- ``thread``: ``async_save``'s defaults (a fresh CPU copy per save, written from a thread);
- ``thread_cached``: a kept ``DefaultStager`` (staging buffers in shared memory, reused);
- ``thread_cached_bg``: the same, staging in a background thread (``use_async_staging``);
- ``process_cached`` / ``process_cached_bg``: the process-based executor
  (``AsyncCheckpointerType.PROCESS``: a daemon process per rank writes, handed the shared-memory
  staging) with the kept stager, staging in line or in the background.
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

__all__ = ["SWEEP", "DcpGroup", "DcpOptions"]


@dataclass(frozen=True, kw_only=True)
class DcpOptions:
    """One configuration of DCP's asynchronous save."""

    name: str
    process: bool
    """``AsyncCheckpointerType.PROCESS`` (else THREAD)."""
    cached: bool
    """A ``DefaultStager`` kept across saves (shared-memory staging buffers reused)."""
    background_staging: bool = False
    """``use_async_staging``: the copy runs in a thread; the next update waits for it."""


SWEEP: tuple[DcpOptions, ...] = (
    DcpOptions(name="thread", process=False, cached=False),
    DcpOptions(name="thread_cached", process=False, cached=True),
    DcpOptions(name="thread_cached_bg", process=False, cached=True, background_staging=True),
    DcpOptions(name="process_cached", process=True, cached=True),
    DcpOptions(name="process_cached_bg", process=True, cached=True, background_staging=True),
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DcpGroup:
    """``world`` DDP ranks of the ``size`` workload, alive until :meth:`close`."""

    def __init__(self, world: int, size: str, *, threads: int = 1) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        port = _free_port()
        self.world = world
        self.commands = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main, args=(r, world, port, size, threads,
                                                            self.commands[r], self.results))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.state_bytes = int(self._gather("ready")[0]["state_bytes"])

    def _gather(self, kind: str, timeout_s: float = 900) -> list[dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        end = time.monotonic() + timeout_s
        while len(out) < self.world:
            try:
                msg = self.results.get(timeout=min(5.0, max(0.1, end - time.monotonic())))
            except queue.Empty:
                dead = [p.pid for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > end:
                    raise RuntimeError(f"DCP ranks {dead} died or timed out ({kind})") from None
                continue
            if "error" in msg:
                raise RuntimeError(f"DCP rank {msg['rank']}: {msg['error']}")
            assert msg["kind"] == kind, (msg, kind)
            out[msg["rank"]] = msg
        return [out[r] for r in range(self.world)]

    def _send(self, **cmd: Any) -> list[dict[str, Any]]:
        for q in self.commands:
            q.put(cmd)
        return self._gather(cmd["kind"])

    def run(self, steps: int, every: int, options: DcpOptions, ckpt_dir: str) -> dict[str, Any]:
        """``steps`` steps, saving every ``every`` (0: never) under ``ckpt_dir``: the run's wall
        (slowest rank), per save the slowest rank's blocking time, and the newest checkpoint."""
        got = self._send(kind="run", steps=steps, every=every, options=options,
                         ckpt_dir=ckpt_dir)
        saves = len(got[0]["blocks"])
        return {"wall_s": max(g["wall_s"] for g in got),
                "blocks_s": [max(g["blocks"][i] for g in got) for i in range(saves)],
                "saves": saves, "last": got[0]["last"], "step_s": max(g["step_s"] for g in got)}

    def restore(self, path: str) -> float:
        """Every rank loads checkpoint ``path`` into its model and optimizer (``dcp.load``);
        seconds from the first start to the last end."""
        got = self._send(kind="restore", path=path)
        return max(g["t1"] for g in got) - min(g["t0"] for g in got)

    def close(self) -> None:
        for q in self.commands:
            q.put({"kind": "stop"})
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


# ---- inside each rank ---------------------------------------------------------------------------


class _Rank:
    def __init__(self, rank: int, world: int, size: str) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from bench import common

        self.torch, self.common = torch, common
        self.rank, self.world = rank, world
        self.model = DDP(common.make_model(size))
        self.optimizer = common.make_optimizer(self.model.parameters())
        self.dataset = common.make_dataset(size=size)
        self.step = 0
        self.train_step()  # Adam's moments exist from here on
        self.stagers: dict[str, Any] = {}
        # The save's collectives run beside DDP's all-reduce: a group of their own (torchtitan's)
        self.ckpt_group = torch.distributed.new_group(backend="gloo")

    def state_bytes(self) -> int:
        return int(self.common.state_bytes(self.model, self.optimizer))

    def train_step(self, before_update: Any = None) -> None:
        common = self.common
        ids = common.split_ids(common.batch_ids(self.step), self.rank, self.world)
        chunks = common.micro_batches(ids)
        scale = self.world / common.GLOBAL_BATCH  # DDP averages over ranks: sum / global batch
        self.optimizer.zero_grad(set_to_none=False)
        for i, chunk in enumerate(chunks):
            batch = common.load_batch(self.dataset, chunk)
            if i < len(chunks) - 1:
                with self.model.no_sync():
                    (common.loss_fn(self.model, batch) * scale).backward()
            else:
                (common.loss_fn(self.model, batch) * scale).backward()
        if before_update is not None:
            before_update()
        self.optimizer.step()
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def stager(self, options: DcpOptions) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if not options.cached:
            return None
        # One kept stager per staging mode, shared by the executors: a full copy of the state
        # per rank each, so at most two are held whatever the sweep
        key = "background" if options.background_staging else "inline"
        if key not in self.stagers:
            self.stagers[key] = DefaultStager(StagingOptions(
                use_pinned_memory=False, use_shared_memory=True,
                use_async_staging=options.background_staging, use_non_blocking_copy=False))
        return self.stagers[key]

    def run(self, steps: int, every: int, options: DcpOptions, ckpt_dir: str) -> dict[str, Any]:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType,
            AsyncSaveResponse,
        )

        kind = AsyncCheckpointerType.PROCESS if options.process else AsyncCheckpointerType.THREAD
        stager = self.stager(options)
        blocks: list[float] = []
        upload: Future | None = None
        staging: Future | None = None
        last = None

        def wait_staging() -> None:  # before the update changes the state being staged
            nonlocal staging
            if staging is not None:
                t = time.perf_counter()
                staging.result()
                blocks[-1] += time.perf_counter() - t
                staging = None

        dist.barrier()
        t0 = time.perf_counter()
        for i in range(steps):
            self.train_step(wait_staging)
            if every and (i + 1) % every == 0:
                t = time.perf_counter()
                if upload is not None:
                    upload.result()  # the previous save must be done before the next starts
                last = os.path.join(ckpt_dir, f"step_{self.step:09d}")
                got = dcp.async_save(self.state_dict(), checkpoint_id=last,
                                     async_checkpointer_type=kind, async_stager=stager,
                                     process_group=self.ckpt_group)
                if isinstance(got, AsyncSaveResponse):
                    staging, upload = got.staging_completion, got.upload_completion
                else:
                    upload = got
                blocks.append(time.perf_counter() - t)
        wait_staging()
        if upload is not None:
            upload.result()
        dist.barrier()
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "blocks": blocks, "last": last, "step_s": wall / max(steps, 1)}

    def restore(self, path: str) -> dict[str, Any]:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        dist.barrier()
        t0 = time.time()
        sd = self.state_dict()
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        t1 = time.time()
        dist.barrier()
        return {"t0": t0, "t1": t1}

    def close(self) -> None:
        for stager in self.stagers.values():
            stager.close()


def _rank_main(rank: int, world: int, port: int, size: str, threads: int, commands: Any,
               results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        me = _Rank(rank, world, size)
        results.put({"kind": "ready", "rank": rank, "state_bytes": me.state_bytes()})
        while True:
            cmd = commands.get()
            kind = cmd.pop("kind")
            if kind == "stop":
                break
            try:
                out = me.run(**cmd) if kind == "run" else me.restore(**cmd)
            except Exception as err:  # reported to the bench, which stops
                results.put({"rank": rank, "error": f"{type(err).__name__}: {err}"})
                break
            results.put({"kind": kind, "rank": rank, **out})
        me.close()
    finally:
        dist.destroy_process_group()


def remove_checkpoints(ckpt_dir: str, keep: str | None) -> None:
    """Removes every checkpoint under ``ckpt_dir`` but ``keep`` (disk space across runs)."""
    if not os.path.isdir(ckpt_dir):
        return
    for name in os.listdir(ckpt_dir):
        path = os.path.join(ckpt_dir, name)
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
