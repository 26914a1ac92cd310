"""A state's part read out of a same-node source's memory, or sent over the group.

Two real processes on a gloo group: the joiner reads the source's buffers with
``process_vm_readv`` when it may (``RunConfig.state_by_memory``) and gets the same bytes as
over the group; where the kernel refuses, the part and the rest go over the group; a dead
process's memory is a :class:`peer_memory.PeerGone`, a bad address a refusal.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from planaria.worker import peer_memory
from planaria.worker.collective import Collective
from planaria.worker.transfer_route import ReceiveRoute, SendRoute

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not peer_memory.available(), reason="no process_vm_readv")]


def _parts(seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(300_000, generator=g), torch.randn(7, 3, generator=g)],
            [torch.arange(90_000, dtype=torch.int64), torch.randn(5, generator=g)]]


def _rank(rank: int, port: int, may_read: bool, refuse: bool, q: mp.Queue) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
        comm = Collective(store, 0, rank, 2, join_timeout_s=30, timeout_s=30)
        if rank == 0:
            route = SendRoute(comm, 1)
            tag = route.open(0)
            for part in _parts(0):
                tag = route.send(part, tag, None)
        else:
            if refuse:
                def refused(*_a, **_k):
                    raise peer_memory.Refused(1, "refused for the test")
                peer_memory.read_into = refused  # type: ignore[assignment]
            moved: list[int] = []
            recv = ReceiveRoute(comm, 0, may_read=may_read)
            tag = recv.open(0)
            got = [[torch.zeros_like(t) for t in part] for part in _parts(1)]
            for part in got:
                tag = recv.receive(part, tag, moved.append)
            same = all(torch.equal(a, b) for pa, pb in zip(got, _parts(0), strict=True)
                       for a, b in zip(pa, pb, strict=True))
            q.put(("recv", same, recv.routes, sum(moved)))
        comm.close()
    except Exception as err:  # reported to the test
        q.put(("error", repr(err)))


def _run(may_read: bool, refuse: bool = False) -> tuple:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, may_read, refuse, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    result = q.get(timeout=120)
    for p in procs:
        p.join(60)
    assert result[0] == "recv", result
    return result[1:]


def _nbytes() -> int:
    return sum(t.numel() * t.element_size() for part in _parts(0) for t in part)


def test_a_joiner_on_the_node_reads_the_state_out_of_the_sources_memory():
    assert _run(may_read=True) == (True, ["memory", "memory"], _nbytes())


def test_without_leave_to_read_the_state_goes_over_the_group():
    assert _run(may_read=False) == (True, ["group", "group"], _nbytes())


def test_a_refused_read_sends_that_part_and_the_rest_over_the_group():
    assert _run(may_read=True, refuse=True) == (True, ["group", "group"], _nbytes())


def _hold(q: mp.Queue, done: mp.Event) -> None:
    t = torch.arange(1000, dtype=torch.int64)
    q.put(t.data_ptr())
    done.wait(60)


def test_reading_a_live_peer_then_a_dead_one_and_a_bad_address():
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_hold, args=(q, done))
    p.start()
    address = q.get(timeout=60)
    into = torch.zeros(1000, dtype=torch.int64)
    assert peer_memory.read_into(p.pid, [(into, address, 8000)]) == 8000
    assert torch.equal(into, torch.arange(1000))
    with pytest.raises(peer_memory.Refused):
        peer_memory.read_into(p.pid, [(into, 8, 8000)])  # nothing is mapped there
    with pytest.raises(ValueError, match="8-byte read"):
        peer_memory.read_into(p.pid, [(into, address, 8)])
    done.set()
    p.join(60)
    with pytest.raises(peer_memory.PeerGone):
        peer_memory.read_into(p.pid, [(into, address, 8000)])
