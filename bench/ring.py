"""planaria's out-of-place ring all-reduce against gloo's in-place one, alone.

    python bench/ring.py                       # 3 ranks x 84.6M floats (the realistic size)
    python bench/ring.py --numel 1000000 --rounds 5

Three processes (``--world``), one torch thread each, one gloo group; each round runs, in
turn and in an order rotated every round, every mode on the same buffers:

- ``ring``: :class:`planaria.worker.ring.RingSum` as a step runs it (segments of
  ``ring.SEGMENT_BYTES``: both phases pipelined);
- ``ring_whole``: the same ring with each chunk moved in one piece (no pipelining within
  a chunk); on a ring from before segments, both modes are that ring;
- ``gloo``: ``dist.all_reduce`` in place (what a peer's DDP runs; it writes the source).

Estimator (fixed before the runs): per mode the median over rounds of the slowest rank's
time; ratios are the median of the per-round paired ratios with a bootstrap 95 % interval
(``bench/stats.py``). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

MODES = ("ring", "ring_whole", "gloo")


def _rank(rank: int, world: int, port: int, numel: int, rounds: int, q: Any,
          segment_bytes: int | None) -> None:
    try:
        _measure(rank, world, port, numel, rounds, q, segment_bytes)
    except BaseException as err:  # the parent waits for every rank's report
        q.put((rank, {"error": repr(err)}))
        raise


def _measure(rank: int, world: int, port: int, numel: int, rounds: int, q: Any,
             segment_bytes: int | None) -> None:
    import torch
    import torch.distributed as dist

    from planaria.worker import ring
    from planaria.worker.ring import RingPart, RingSum

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    pg = dist.group.WORLD
    src = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    dst, work = torch.empty_like(src), src.clone()
    default = segment_bytes or getattr(ring, "SEGMENT_BYTES", None)  # None: no segments yet
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds + 1):  # round 0 warms the connections and the memory
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for mode in order:
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "gloo":
                dist.all_reduce(work)
            else:
                ring.SEGMENT_BYTES = default if mode == "ring" else 1 << 62
                RingSum(pg, rank, world, [RingPart(src, dst, numel)]).wait()
            elapsed = time.perf_counter() - t0
            if r:
                times[mode].append(elapsed)
    ring.SEGMENT_BYTES = default
    q.put((rank, times))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from bench import common, stats

    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--numel", type=int, default=84_600_000, help="floats a buffer")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--segment-bytes", type=int, default=None,
                   help="the ring's segment (default: ring.SEGMENT_BYTES)")
    args = p.parse_args(argv)
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    before = common.loadavg()
    procs = [ctx.Process(target=_rank, args=(r, args.world, store.port, args.numel,
                                             args.rounds, q, args.segment_bytes))
             for r in range(args.world)]
    for proc in procs:
        proc.start()
    got = dict(q.get(timeout=1800) for _ in procs)
    failed = {r: g["error"] for r, g in got.items() if "error" in g}
    if failed:
        raise SystemExit(f"ranks failed: {failed}")
    for proc in procs:
        proc.join(timeout=60)
    slowest = {m: [max(got[r][m][i] for r in got) for i in range(args.rounds)] for m in MODES}
    out: dict[str, Any] = {"bench": "ring", "world": args.world, "numel": args.numel,
                           "rounds": args.rounds, "segment_bytes": args.segment_bytes,
                           "loadavg_before": before,
                           "loadavg_after": common.loadavg()}
    for m in MODES:
        out[f"{m}_ms"] = round(1000 * stats.median_ci(slowest[m]).median, 1)
    for a, b in (("ring", "gloo"), ("ring", "ring_whole")):
        est = stats.paired_ratio(slowest[a], slowest[b]).as_dict()
        out[f"{a}_over_{b}"] = {"median": est["median"], "ci95": est["ci95"]}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
