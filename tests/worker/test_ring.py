"""The out-of-place ring all-reduce (planaria.worker.ring) over real gloo groups of processes.

It sums every rank's buffers into the destinations, the same bits on every rank, with the
norm of the sum, and never writes a source: a rank whose peer is dead, or that is told to
leave the ring, still holds its own sum whole (what a failed step keeps).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from planaria.faults.errors import StepAborted
from planaria.worker import ring as ring_mod
from planaria.worker.collective import Collective
from planaria.worker.ring import RingPart

pytestmark = pytest.mark.multiprocess

SIZES = ((1001, torch.float32, 990), (2, torch.bfloat16, 2))  # (numel, dtype, norm's numel)


def _sources(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(n, generator=g).to(dtype) for n, dtype, _ in SIZES]


def _parts(rank: int) -> tuple[list[torch.Tensor], list[RingPart], torch.Tensor]:
    srcs = _sources(rank)
    parts = [RingPart(s, torch.full_like(s, float("nan")), k)
             for s, (_, _, k) in zip(srcs, SIZES, strict=True)]
    return [s.clone() for s in srcs], parts


def _rank(rank: int, world: int, port: int, mode: str, q: mp.Queue) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
        comm = Collective(store, 0, rank, world, join_timeout_s=30, timeout_s=60)
        comm.allreduce_sum([torch.ones(1)])  # every rank is in the group
        if mode == "segmented":  # many segments a chunk: the pipelined path
            ring_mod.SEGMENT_BYTES = 64
        before, parts = _parts(rank)
        if mode == "dead" and rank == world - 1:
            os._exit(0)  # its connections close: the ring's peers see it
        if mode == "stall" and rank == 1:
            time.sleep(30)  # alive, connections open, never in the ring
            return
        if mode == "stall":
            threading.Timer(0.5, comm.interrupt).start()
        works = comm.ring_sum_start(parts)
        ring = works[0]  # wait_all empties the list on a failure
        t0 = time.monotonic()
        try:
            comm.wait_all(works)
            outcome = "summed"
        except StepAborted:
            outcome = "interrupted"
        except RuntimeError as err:
            outcome = f"failed: {str(err)[:80]}"
        intact = all(torch.equal(a, p.src) for a, p in zip(before, parts, strict=True))
        sums = [p.dst.double().tolist() for p in parts]  # exact; no tensor through the queue
        q.put((rank, outcome, time.monotonic() - t0, intact, sums,
               ring.square_sum, ring.running()))
    except Exception as err:
        q.put((rank, f"error: {err!r}", 0.0, False, [], 0.0, False))


def _run(world: int, mode: str, reports: int) -> list[tuple]:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, store.port, mode, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return sorted([q.get(timeout=90) for _ in range(reports)], key=lambda g: g[0])
    finally:
        for p in procs:
            p.kill()


def test_the_ring_sums_every_ranks_buffers_the_same_on_every_rank_with_the_norm():
    got = _run(3, "sum", 3)
    assert [g[1] for g in got] == ["summed"] * 3, got
    assert all(g[3] for g in got)  # no source written
    expected = [sum(_sources(r)[i].double() for r in range(3)) for i in range(len(SIZES))]
    for i, (_, dtype, _) in enumerate(SIZES):
        first = torch.tensor(got[0][4][i], dtype=torch.float64)
        assert all(g[4][i] == got[0][4][i] for g in got)  # bit for bit on every rank
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(first, expected[i], atol=tol, rtol=tol)
    square = sum(float(torch.tensor(got[0][4][i][:k]).square().sum())
                 for i, (_, _, k) in enumerate(SIZES))
    assert {g[5] for g in got} == {got[0][5]}  # the same norm on every rank
    assert got[0][5] == pytest.approx(square, rel=1e-5)  # the tail past norm_numel left out


def test_a_ring_in_many_segments_sums_the_same_bits_as_in_one():
    whole, segmented = _run(3, "sum", 3), _run(3, "segmented", 3)
    assert [g[1] for g in segmented] == ["summed"] * 3, segmented
    assert all(g[3] for g in segmented)  # no source written
    assert [g[4] for g in segmented] == [g[4] for g in whole]  # bit for bit
    assert [g[5] for g in segmented] == [g[5] for g in whole]


def test_a_dead_peer_fails_the_ring_and_every_survivor_keeps_its_own_sum():
    got = _run(3, "dead", 2)
    assert [g[1][:7] for g in got] == ["failed:"] * 2, got
    assert all(g[2] < 10 for g in got)  # the closed connection, not the 60 s timeout
    assert all(g[3] for g in got)


def test_an_interrupt_leaves_a_ring_whose_peer_never_comes_the_own_sum_whole():
    got = _run(2, "stall", 1)
    rank, outcome, waited, intact, _, _, running = got[0]
    assert (rank, outcome) == (0, "interrupted"), got
    assert 0.4 < waited < 3.0  # the interrupt's 0.5 s, not the group's 60
    assert intact
    assert running  # its thread waits on on the peer: its buffers are not to be reused
