"""Staged transfers (tensors on another device than the group's) over a real gloo group.

On a GPU machine a tensor is staged when it lives elsewhere than the group's
device (CUDA state over gloo, Adam's host-side step counters over NCCL). Here,
without a GPU, the same code path is forced on one side: the staged side must
exchange the same bytes, in the same chunk order and tags, as an unstaged peer,
through a bounded pool of reused buffers.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from planaria.worker import collective
from planaria.worker.collective import Collective

pytestmark = pytest.mark.multiprocess

SHAPES = [(3,), (1000, 7), (40_000,), (5,)]  # chunks of 64 KiB: some tensors span several


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=g) for s in SHAPES]
    out.append(torch.arange(70_000, dtype=torch.int64))
    return out


def _rank(rank: int, port: int, staged: bool, q: mp.Queue) -> None:
    try:
        collective.CHUNK_BYTES = 64 << 10
        collective.STAGING_SLOTS = 2
        store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
        comm = Collective(store, 0, rank, 2, join_timeout_s=30, timeout_s=30)
        if staged:
            comm._native = lambda t: False  # as if every tensor lived on another device
        mine = _tensors(rank)
        if rank == 0:
            comm.send(mine, 1)
        else:
            got = [torch.empty_like(t) for t in mine]
            comm.recv(got, 0)
            q.put(("recv", all(torch.equal(a, b) for a, b in zip(got, _tensors(0), strict=True))))
        for src in (0, 1):
            buf = _tensors(rank)[2].clone()
            comm.broadcast(buf, src)
            q.put((f"bcast{src}", torch.equal(buf, _tensors(src)[2])))
        q.put(("slots", len(comm._staging) <= collective.STAGING_SLOTS))
        comm.close()
    except Exception as err:  # reported to the test
        q.put(("error", repr(err)))


@pytest.mark.parametrize("staged", [(True, False), (False, True)])
def test_staged_transfers_match_an_unstaged_peer(staged):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, staged[r], q)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    results = []
    while not q.empty():
        results.append(q.get())
    assert not [r for r in results if r[0] == "error"], results
    assert ("recv", True) in results
    assert [r for r in results if r[0].startswith("bcast")] and all(
        ok for what, ok in results if what.startswith("bcast")
    )
    assert all(ok for what, ok in results if what == "slots")
