"""What a checkpoint costs a training run, through the real runtime (Ray actors).

    python bench/checkpoint.py [--replicas 3] [--hidden 2048] [--repeat 5] [--workdir /tmp/x]
    python bench/checkpoint.py --quick       # tiny state, for the smoke test

Measures, on one job (local disk):

- ``extra_wall_per_ckpt_s``: the wall time a checkpoint adds to training while
  training goes on: windows of the same number of steps with and without an
  asynchronous save in flight, interleaved, the median of the differences (the
  snapshot's stall, the background write's contention for CPU and memory
  bandwidth, and any wait for the save at the window's end);
- baselines on the same state, side by side: a synchronous safetensors save
  (``sync_save_s``, one file, fsynced), ``torch.save`` (``torch_save_s``), and
  ``torch.distributed.checkpoint.async_save`` (``dcp_async_extra_wall_s``,
  measured like planaria's: step windows with and without it in flight; it runs
  in the controller process on a CPU copy of the state, one rank);
- ``stall_ratio`` = ``extra_wall_per_ckpt_s`` / ``sync_save_s``;
- restore: every replica loading the newest checkpoint (each strategy) against a
  raw read of the same files (one process, no checks), with the page cache
  dropped per file (``posix_fadvise(DONTNEED)``; ``page_cache_dropped`` says
  whether the cold raw read really was slower than the warm one, i.e. whether
  the storage did not serve it from a host cache) and warm.

The last line printed is one JSON object (``"bench": "checkpoint"``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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
from planaria.checkpoint.config import CheckpointConfig  # noqa: E402

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


def steps(job: Job, k: int) -> float:
    """Seconds for ``k`` training steps (a save in flight advances at each boundary)."""
    t0 = time.perf_counter()
    for _ in range(k):
        job.train_step()
    job.commit_all()
    return time.perf_counter() - t0


def fsynced(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def window_steps(job: Job, quick: bool) -> int:
    """Steps per window: enough to cover a background save twice (a warm-up save, which
    also allocates the staging buffers, measures it)."""
    ck = job.checkpointer
    step_s = steps(job, 3) / 3
    job.commit_all()
    t0 = time.perf_counter()
    ck.saves.start(reason="bench")
    ck.saves.finish_within(600)
    save_s = time.perf_counter() - t0
    k = max(3, int(2 * save_s / max(step_s, 1e-3)) + 1)
    return min(k, 8 if quick else 200)


def planaria_extra(job: Job, k: int, repeat: int) -> dict[str, float]:
    """Median extra wall time of a window of ``k`` steps with a planaria save in flight."""
    ck = job.checkpointer
    extras, stalls, syncs = [], [], []
    for _ in range(repeat):
        base = steps(job, k)
        step = job.steps_done
        t0 = time.perf_counter()
        ck.saves.start(reason="bench")  # what a step boundary does when a save is due
        stalls.append(time.perf_counter() - t0)
        for _ in range(k):
            job.train_step()  # each boundary collects the save's progress, never waiting
        ck.saves.finish_within(600)  # a save still running at the window's end blocks here
        job.commit_all()
        extras.append(time.perf_counter() - t0 - base)
        assert ck.last_committed == step, (ck.last_committed, step)
        job.train_step()
        syncs.append(timed(lambda: ck.save_now(reason="bench")))
    print("planaria windows: extra wall per checkpoint (s):", [round(x, 3) for x in extras],
          flush=True)
    return {"extra_wall_per_ckpt_s": statistics.median(extras),
            "stall_s": statistics.median(stalls),
            "planaria_sync_save_s": statistics.median(syncs)}


def baselines(job: Job, k: int, repeat: int, workdir: Path) -> dict[str, float]:
    """The same state saved by safetensors (sync), torch.save (sync) and DCP async_save
    (extra wall over a window of ``k`` steps, like planaria's)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    tensors, _ = job.state()
    state = {k_: v.contiguous() for k_, v in tensors.items()}
    out: dict[str, list[float]] = {"sync_save_s": [], "torch_save_s": [],
                                   "dcp_async_extra_wall_s": []}
    for i in range(repeat):
        st_path, pt_path = workdir / f"sync{i}.safetensors", workdir / f"save{i}.pt"
        t0 = time.perf_counter()
        save_file(state, str(st_path))
        fsynced(st_path)
        out["sync_save_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.save(state, pt_path)
        fsynced(pt_path)
        out["torch_save_s"].append(time.perf_counter() - t0)
        st_path.unlink()
        pt_path.unlink()
        base = steps(job, k)
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(workdir / f"dcp{i}"))
        for _ in range(k):
            job.train_step()
        fut.result()
        job.commit_all()
        out["dcp_async_extra_wall_s"].append(time.perf_counter() - t0 - base)
        shutil.rmtree(workdir / f"dcp{i}", ignore_errors=True)
    print("DCP windows: extra wall per checkpoint (s):",
          [round(x, 3) for x in out["dcp_async_extra_wall_s"]], flush=True)
    return {key: statistics.median(v) for key, v in out.items()}


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
            out[f"{mode}_restore_{strategy}_s"] = statistics.median(times)
        raws = []
        for _ in range(repeat):
            if mode == "cold":
                drop_cache(root)
            raws.append(timed(lambda: raw_read(path)))
        out[f"{mode}_raw_s"] = statistics.median(raws)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=11, help="pairs of windows (medians)")
    ap.add_argument("--workdir", "--dir", dest="workdir", default=None)
    ap.add_argument("--quick", action="store_true", help="tiny state, 3 repeats (smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.replicas, args.hidden, args.layers, args.repeat = 2, 256, 2, 3
    base = Path(tempfile.mkdtemp(prefix="planaria-ckpt-bench-", dir=args.workdir))
    spec = make_spec(args.hidden, args.layers)
    root = str(base / "checkpoints")
    never = 10**9  # saves only when the bench asks
    out: dict[str, Any] = {"bench": "checkpoint", "replicas": args.replicas,
                           "cpus": os.cpu_count(), "quick": args.quick, "repeat": args.repeat}
    try:
        cfg = CheckpointConfig(root=root, every=never, keep_last=None)
        run = RunConfig(steps=never, replicas=args.replicas, run_dir=base / "n",
                        threads_per_worker=1)
        with Job(spec, run, checkpoint=cfg) as job:
            job.train_step()
            tensors, _ = job.state()
            out["state_mb"] = round(sum(t.numel() * t.element_size()
                                        for t in tensors.values()) / 1e6, 1)
            del tensors
            k = window_steps(job, args.quick)
            out["steps_per_window"] = k
            out["step_s"] = round(steps(job, k) / k, 4)
            out.update({key: round(v, 4)
                        for key, v in planaria_extra(job, k, args.repeat).items()})
            out.update({key: round(v, 4)
                        for key, v in baselines(job, k, args.repeat, base).items()})
            out.update({key: round(v, 4) for key, v in restores(job, root, args.repeat).items()})
    finally:
        shutil.rmtree(base, ignore_errors=True)
    mb = out["state_mb"]
    out["stall_ratio"] = round(out["extra_wall_per_ckpt_s"] / out["sync_save_s"], 4)
    best = min(out["cold_restore_read_all_s"], out["cold_restore_share_s"])
    out["restore_vs_raw"] = round(out["cold_raw_s"] / best, 3)
    out["warm_restore_vs_raw"] = round(
        out["warm_raw_s"] / min(out["warm_restore_read_all_s"], out["warm_restore_share_s"]), 3)
    out["page_cache_dropped"] = out["cold_raw_s"] > 1.25 * out["warm_raw_s"]
    n = args.replicas
    print(f"state: {mb} MB over {n} replicas; windows of {out['steps_per_window']} steps "
          f"({out['step_s']:.3f} s/step), medians of {args.repeat}")
    print(f"extra wall per checkpoint: planaria {out['extra_wall_per_ckpt_s']:.3f} s (snapshot "
          f"stall {out['stall_s']:.3f} s), DCP async_save {out['dcp_async_extra_wall_s']:.3f} s")
    print(f"synchronous saves: safetensors {out['sync_save_s']:.3f} s, torch.save "
          f"{out['torch_save_s']:.3f} s, planaria {out['planaria_sync_save_s']:.3f} s "
          f"-> stall ratio {out['stall_ratio']:.3f}")
    for mode in ("cold", "warm"):
        print(f"{mode}: raw read {mb / out[f'{mode}_raw_s']:.0f} MB/s; restore into {n} replicas: "
              f"read_all {out[f'{mode}_restore_read_all_s']:.3f} s, share+broadcast "
              f"{out[f'{mode}_restore_share_s']:.3f} s")
    print(f"restore vs raw read: {out['restore_vs_raw']:.2f} (cold), "
          f"{out['warm_restore_vs_raw']:.2f} (warm)"
          + ("" if out["page_cache_dropped"] else
             "; the cold raw read was not slower than the warm one: this storage serves it "
             "from a host cache, so 'cold' is not cold here"))
    keys = ["bench", "extra_wall_per_ckpt_s", "sync_save_s", "dcp_async_extra_wall_s",
            "torch_save_s", "stall_ratio", "restore_vs_raw", "state_mb", "stall_s",
            "page_cache_dropped"]
    print(json.dumps({**{k_: out[k_] for k_ in keys}, "details": out}))


if __name__ == "__main__":
    main()
