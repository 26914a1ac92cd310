"""Checkpoints through the real runtime: 3 replicas (Ray actors), ≥200 MB of state.

    python bench/checkpoint.py [--replicas 3] [--hidden 2048] [--dir /tmp/x] [--repeat 3]

Measures, on one job:

- the blocking stall of an asynchronous save (apply the committed step, snapshot
  each replica's share into its reused staging buffers) against a synchronous
  save of the same state (the same, plus writing every shard and committing);
- save time with N writers (the replicas) against 1 (a 1-replica job resumed
  from the N-replica checkpoint);
- restore: in-process, every replica loading the newest checkpoint (each
  strategy), against a raw read of the same files (one process, the loader's
  parallelism, no checks), with the page cache dropped (``cold``) and warm.

The last line printed is one JSON object (``"bench": "checkpoint"``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.checkpoint_io import drop_cache, raw_read  # noqa: E402
from planaria import Job, RunConfig, TrainSpec  # noqa: E402
from planaria.checkpointing import CheckpointConfig  # noqa: E402

DIM, CLASSES = 256, 16


def make_model(hidden: int, layers: int) -> nn.Module:
    """An MLP whose parameters are ~75 MB at hidden=2048, layers=4 (x3 with Adam)."""
    blocks: list[nn.Module] = [nn.Linear(DIM, hidden), nn.GELU()]
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, CLASSES))


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 1024) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, DIM, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def make_spec(hidden: int, layers: int) -> TrainSpec:
    return TrainSpec(
        model=lambda: make_model(hidden, layers),
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-4),
        loss=loss,
        dataset=Data,
        global_batch_size=12,
        micro_batch_size=4,
        name="bench-checkpoint",
    )


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def saves(job: Job, repeat: int) -> dict[str, float]:
    """Async stall and total, then sync save time, each the best of ``repeat`` after a warm-up
    (the first save allocates the staging buffers)."""
    ck = job.checkpointer
    stalls, async_totals, syncs = [], [], []
    for i in range(repeat + 1):
        job.train_step()
        job.commit_all()  # apply the step's update first: it is not part of the save
        t0 = time.perf_counter()
        ck._start(reason="bench")  # what a step boundary does when a save is due
        stall = time.perf_counter() - t0
        ck._finish(600)
        total = time.perf_counter() - t0
        assert ck.last_committed == job.steps_done
        job.train_step()
        job.commit_all()
        sync = timed(lambda: ck.save_now(reason="bench"))
        assert ck.last_committed == job.steps_done
        if i:
            stalls.append(stall)
            async_totals.append(total)
            syncs.append(sync)
    return {"stall_s": min(stalls), "async_save_s": min(async_totals), "sync_save_s": min(syncs)}


def restores(job: Job, root: str, repeat: int) -> dict[str, Any]:
    ck = job.checkpointer
    path = ck.last_path
    assert path is not None
    out: dict[str, Any] = {}
    for mode in ("cold", "warm"):
        for strategy in ("read_all", "share"):
            ck.config.restore_strategy = strategy  # type: ignore[assignment]
            times = []
            for _ in range(repeat):
                if mode == "cold":
                    drop_cache(root)
                times.append(timed(lambda: ck.restore(reason="bench")))
            out[f"{mode}_restore_{strategy}_s"] = min(times)
        raws = []
        for _ in range(repeat):
            if mode == "cold":
                drop_cache(root)
            raws.append(timed(lambda: raw_read(path)))
        out[f"{mode}_raw_s"] = min(raws)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="planaria-ckpt-bench-", dir=args.dir))
    spec = make_spec(args.hidden, args.layers)
    root = str(base / "checkpoints")
    never = 10**9  # saves only when the bench asks
    out: dict[str, Any] = {"bench": "checkpoint", "replicas": args.replicas,
                           "cpus": os.cpu_count()}
    try:
        cfg = CheckpointConfig(root=root, every=never, keep_last=None)
        run = RunConfig(steps=never, replicas=args.replicas, run_dir=base / "n",
                        threads_per_worker=1)
        with Job(spec, run, checkpoint=cfg) as job:
            job.train_step()
            tensors, _ = job.state()
            state_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
            out["state_mb"] = round(state_bytes / 1e6, 1)
            many = saves(job, args.repeat)
            out.update({f"{k}": round(v, 4) for k, v in many.items()})
            out.update({k: round(v, 4) for k, v in restores(job, root, args.repeat).items()})
        one = RunConfig(steps=never, replicas=1, run_dir=base / "one", threads_per_worker=1)
        with Job(spec, one, checkpoint=cfg) as job:
            single = saves(job, args.repeat)
        out["sync_save_1_writer_s"] = round(single["sync_save_s"], 4)
        out["async_save_1_writer_s"] = round(single["async_save_s"], 4)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    mb = out["state_mb"]
    out["stall_ratio"] = round(out["stall_s"] / out["sync_save_s"], 4)
    out["parallel_save_speedup"] = round(out["sync_save_1_writer_s"] / out["sync_save_s"], 3)
    best = min(out["cold_restore_read_all_s"], out["cold_restore_share_s"])
    out["restore_vs_raw"] = round(out["cold_raw_s"] / best, 3)
    out["warm_restore_vs_raw"] = round(
        out["warm_raw_s"] / min(out["warm_restore_read_all_s"], out["warm_restore_share_s"]), 3)
    n = args.replicas
    print(f"state: {mb} MB over {n} replicas")
    print(f"async save: stall {out['stall_s']:.3f} s (snapshot), whole save "
          f"{out['async_save_s']:.3f} s; sync save {out['sync_save_s']:.3f} s "
          f"-> stall is {100 * out['stall_ratio']:.1f}% of a sync save")
    print(f"sync save with {n} writers {out['sync_save_s']:.3f} s, with 1 writer "
          f"{out['sync_save_1_writer_s']:.3f} s -> {out['parallel_save_speedup']:.2f}x")
    for mode in ("cold", "warm"):
        print(f"{mode}: raw read {mb / out[f'{mode}_raw_s']:.0f} MB/s; restore into {n} replicas: "
              f"read_all {out[f'{mode}_restore_read_all_s']:.3f} s "
              f"({mb / out[f'{mode}_restore_read_all_s']:.0f} MB/s per replica), share+broadcast "
              f"{out[f'{mode}_restore_share_s']:.3f} s")
    print(f"restore vs raw read: {out['restore_vs_raw']:.2f} (cold), "
          f"{out['warm_restore_vs_raw']:.2f} (warm)")
    keys = ["bench", "state_mb", "stall_s", "sync_save_s", "stall_ratio", "parallel_save_speedup",
            "restore_vs_raw"]
    print(json.dumps({**{k: out[k] for k in keys}, "details": out}))


if __name__ == "__main__":
    main()
