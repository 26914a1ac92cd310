"""Stand-alone checkpoint I/O measurements (no Ray): save with 1 vs N writers, and restore
throughput against a raw read of the same files, cold (pages dropped) and warm.

    python bench/checkpoint_io.py [--mb 256] [--writers 3] [--dir /tmp/x]

Prints one JSON line. Writers are threads in one process here; the runtime bench
runs them as separate worker processes.

Also the pieces ``bench/checkpoint.py`` measures with: a cold page cache
(:func:`make_cold`), a raw read of a checkpoint's files (:func:`raw_read`), one memory
copy of a worker's share (:func:`memcpy_s`) and the percentile bootstrap of its
estimators (:func:`bootstrap_median`, :func:`paired_ratio`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from planaria.checkpoint import (
    StagingBuffers,
    commit_checkpoint,
    load_checkpoint,
    new_save_id,
    plan_shards,
    take_share,
    write_shard,
)
from planaria.checkpoint.checksum import byte_view


def make_state(total_mb: int) -> dict[str, torch.Tensor]:
    """A model-and-optimizer-like state: many mid-size tensors, one big embedding."""
    state: dict[str, torch.Tensor] = {"model/embed.weight": torch.randn(total_mb * 1024 // 16,
                                                                        1024)}
    per_layer = (total_mb * 3 // 4) * (1 << 20) // 3 // 4 // 16  # 16 layers x 3 tensors
    side = int(per_layer**0.5)
    for i in range(16):
        w = torch.randn(side, side)
        state[f"model/layers.{i}.weight"] = w
        state[f"optim/{i}/exp_avg"] = torch.randn(side, side)
        state[f"optim/{i}/exp_avg_sq"] = torch.rand(side, side).bfloat16()
        state[f"optim/{i}/step"] = torch.tensor(i)
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def drop_cache(path: str) -> bool:
    """Evicts the files under ``path`` from the page cache (clean pages; no root needed)."""
    ok = hasattr(os, "posix_fadvise")
    for dirpath, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                if ok:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return ok


def save(root: str, step: int, state: dict[str, torch.Tensor], writers: int,
         staging: list[StagingBuffers]) -> dict[str, float]:
    plans = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, writers)
    sid = new_save_id()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:  # snapshots in parallel, like N workers would
        shares = list(pool.map(lambda p: take_share(state, p, staging[p.index]), plans))
    stall = time.perf_counter() - t0
    with ThreadPoolExecutor(writers) as pool:
        records = list(pool.map(
            lambda p: write_shard(root, step, p.index, writers, shares[p.index], save_id=sid),
            plans))
    write = time.perf_counter() - t0 - stall
    commit_checkpoint(root, step, records, {"step": step}, world_size=writers)
    total = time.perf_counter() - t0
    return {"stall_s": stall, "write_s": write, "commit_s": total - stall - write,
            "save_s": total}


def make_cold(paths: list[str]) -> str:
    """Drops the page cache before a cold read: the whole machine's (``drop_caches``, as
    root) where this kernel lets us, else the files under ``paths`` (``posix_fadvise``).
    Returns which was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for path in paths:
            drop_cache(path)
        return "fadvise_dontneed"


def checkpoint_files(path: str, suffixes: tuple[str, ...] | None = None) -> list[str]:
    """The regular files under ``path`` (those ending in one of ``suffixes``, if given)."""
    out = []
    for dirpath, _, names in os.walk(path):
        out += [os.path.join(dirpath, n) for n in sorted(names)
                if suffixes is None or n.endswith(suffixes)]
    return sorted(out)


def _read_file_into(path: str, buf: torch.Tensor) -> int:
    """Reads file ``path`` whole into ``buf`` (its size), 8 MB a read; returns the bytes."""
    view, size = byte_view(buf), buf.numel()
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < size:
            n = f.readinto(view[pos : pos + (8 << 20)])
            assert n
            pos += n
    return size


def raw_read(path: str, suffixes: tuple[str, ...] | None = (".safetensors",)) -> int:
    """Reads every shard file (``suffixes``; None: every file) into fresh buffers with the
    loader's parallelism, no checks; returns the bytes read."""
    files = checkpoint_files(path, suffixes)

    def one(p: str) -> int:
        return _read_file_into(p, torch.empty(os.path.getsize(p), dtype=torch.uint8))

    with ThreadPoolExecutor(min(4, len(files))) as pool:
        return sum(pool.map(one, files))


def _read_into(files: list[str], buffers: list[list[torch.Tensor]]) -> int:
    jobs = [(p, b) for bufs in buffers for p, b in zip(files, bufs, strict=True)]
    with ThreadPoolExecutor(min(4 * len(buffers), len(jobs))) as pool:
        return sum(pool.map(lambda job: _read_file_into(*job), jobs))


def _raw_readers_main(files: list[str], readers: int, conn: Any) -> None:
    """A :class:`RawReaders` process: allocates and touches its buffers, then reads every
    time it is told to, and answers with the seconds each read took."""
    buffers = [[torch.ones(os.path.getsize(p), dtype=torch.uint8) for p in files]
               for _ in range(readers)]
    conn.send("ready")
    while conn.recv() == "read":
        t0 = time.perf_counter()
        _read_into(files, buffers)
        conn.send(time.perf_counter() - t0)


class RawReaders:
    """``readers`` plain readers of every file under ``path`` (``suffixes``; None: every
    file) at once, each into its own buffers: the reads a restore of ``readers`` replicas on
    one node makes when each reads the whole checkpoint (the page cache serves the disk's
    bytes once). They run in a process of their own, their buffers allocated and touched
    before any read is timed (a restore reads into the replicas' live, touched memory);
    :meth:`close` ends it, which gives the memory back whatever this process holds."""

    def __init__(self, path: str, readers: int,
                 suffixes: tuple[str, ...] | None = (".safetensors",)) -> None:
        ctx = multiprocessing.get_context("spawn")  # not fork: this process runs Ray's threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_raw_readers_main, daemon=True,
                                 args=(checkpoint_files(path, suffixes), readers, child))
        self._proc.start()
        child.close()
        if self._conn.recv() != "ready":
            raise RuntimeError("the raw readers' process did not start")

    def read(self) -> float:
        """One read of every file by every reader; the seconds it took (timed in there)."""
        self._conn.send("read")
        return float(self._conn.recv())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()


def memcpy_s(nbytes: int, repeat: int = 5) -> float:
    """The median time of one ``copy_`` of ``nbytes`` into preallocated, already touched
    memory: the floor of a snapshot of that many bytes."""
    src = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch outside the timing, as reused staging buffers are
    return statistics.median(timed(lambda: dst.copy_(src)) for _ in range(repeat))


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--writers", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="planaria-ckpt-bench-", dir=args.dir)
    try:
        state = make_state(args.mb)
        size = nbytes(state)
        out: dict[str, Any] = {"bench": "checkpoint_io", "state_bytes": size,
                               "writers": args.writers, "cpus": os.cpu_count()}
        for n in (1, args.writers):
            root = os.path.join(base, f"w{n}")
            staging = [StagingBuffers() for _ in range(n)]
            runs = [save(root, s, state, n, staging) for s in range(args.repeat + 1)]
            out[f"save_w{n}_first"] = {k: round(v, 3) for k, v in runs[0].items()}
            best = min(runs[1:], key=lambda r: r["save_s"])
            out[f"save_w{n}"] = {k: round(v, 3) for k, v in best.items()}
            out[f"save_w{n}_gb_per_s"] = round(size / best["save_s"] / 1e9, 3)
        path = os.path.join(base, f"w{args.writers}", f"step_{args.repeat:09d}")
        load = lambda: load_checkpoint(path)  # noqa: E731
        load_noverify = lambda: load_checkpoint(path, verify=False)  # noqa: E731
        raw = lambda: raw_read(path)  # noqa: E731
        for mode in ("cold", "warm"):
            res = {}
            for name, fn in (("raw", raw), ("restore", load), ("restore_noverify", load_noverify)):
                times = []
                for _ in range(args.repeat):
                    if mode == "cold":
                        out["cold_cache_dropped"] = drop_cache(path)
                    times.append(timed(fn))
                res[name] = min(times)
            out[f"{mode}_raw_gb_per_s"] = round(size / res["raw"] / 1e9, 3)
            out[f"{mode}_restore_gb_per_s"] = round(size / res["restore"] / 1e9, 3)
            out[f"{mode}_restore_noverify_gb_per_s"] = round(
                size / res["restore_noverify"] / 1e9, 3)
            out[f"{mode}_restore_vs_raw"] = round(res["raw"] / res["restore"], 3)
        tensors, _ = load_checkpoint(path)
        assert all(torch.equal(tensors[k], state[k]) for k in state)
        print(json.dumps(out))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
