"""A state's part read out of a same-node source's memory, or sent over the group.

Two real processes on a gloo group: the joiner reads the source's buffers with
``process_vm_readv`` when it may (``RunConfig.state_by_memory``) and gets the same bytes as
over the group; where the kernel refuses, the part and the rest go over the group; the
source hears of the bytes read as the joiner reads them (its progress); a dead process's
memory is a :class:`peer_memory.PeerGone`, a bad address a refusal.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from planaria.worker import peer_memory, transfer_route
from planaria.worker.collective import Collective
from planaria.worker.transfer_route import ReceiveRoute, SendRoute

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not peer_memory.available(), reason="no process_vm_readv")]


def _parts(seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(300_000, generator=g), torch.randn(7, 3, generator=g)],
            [torch.arange(90_000, dtype=torch.int64), torch.randn(5, generator=g)]]


def _slowly(read_into):
    """``read_into`` whose chunks of 128 KiB take 0.15 s each (the source hears every
    256 KiB): the model's part takes ~1.6 s, the rest ~1 s."""
    peer_memory.CHUNK_BYTES = 128 << 10
    transfer_route.ANSWER_BYTES = 256 << 10

    def slow(pid, pairs, on_progress=None):
        def each(n):
            time.sleep(0.15)
            on_progress(n)
        return read_into(pid, pairs, each)

    return slow


def _rank(rank: int, port: int, may_read: bool, how: str, q: mp.Queue) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
        comm = Collective(store, 0, rank, 2, join_timeout_s=30, timeout_s=30)
        if rank == 0:
            told: list[int] = []
            route = SendRoute(comm, 1)
            tag = route.open(0)
            for part in _parts(0):
                tag = route.send(part, tag, told.append)
            q.put(("sent", sum(told), len(told)))
        else:
            if how == "refuse":
                def refused(*_a, **_k):
                    raise peer_memory.Refused(1, "refused for the test")
                peer_memory.read_into = refused  # type: ignore[assignment]
            elif how == "refuse midway":  # after 384 KiB read: the source heard of 256
                peer_memory.CHUNK_BYTES = 128 << 10
                transfer_route.ANSWER_BYTES = 256 << 10
                read_into = peer_memory.read_into

                def midway(pid, pairs, on_progress=None):
                    def each(n):
                        on_progress(n)
                        if each.chunks == 2:
                            raise peer_memory.Refused(1, "refused midway for the test")
                        each.chunks += 1
                    each.chunks = 0
                    return read_into(pid, pairs, each)
                peer_memory.read_into = midway  # type: ignore[assignment]
            elif how == "slow":
                peer_memory.read_into = _slowly(peer_memory.read_into)  # type: ignore[assignment]
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


def _run(may_read: bool, how: str = "") -> tuple:
    """The receiver's (same bytes, routes, bytes it moved), once the source told as many."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, may_read, how, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict((r[0], r[1:]) for r in (q.get(timeout=120), q.get(timeout=120)))
    for p in procs:
        p.join(60)
    assert set(results) == {"sent", "recv"}, results
    (same, routes, moved), (told, times) = results["recv"], results["sent"]
    assert told == moved  # the source heard of every byte read (or sent it)
    return same, routes, moved, times


def _nbytes() -> int:
    return sum(t.numel() * t.element_size() for part in _parts(0) for t in part)


def test_a_joiner_on_the_node_reads_the_state_out_of_the_sources_memory():
    assert _run(may_read=True)[:3] == (True, ["memory", "memory"], _nbytes())


def test_without_leave_to_read_the_state_goes_over_the_group():
    assert _run(may_read=False)[:3] == (True, ["group", "group"], _nbytes())


def test_a_refused_read_sends_that_part_and_the_rest_over_the_group():
    assert _run(may_read=True, how="refuse")[:3] == (True, ["group", "group"], _nbytes())


def test_a_read_refused_midway_counts_each_byte_once():
    """Refused after 384 KiB of the model's part (the source heard of 256 KiB): the part goes
    over the group, and neither end counts the bytes read before it twice."""
    same, routes, moved, _ = _run(may_read=True, how="refuse midway")
    assert (same, routes, moved) == (True, ["group", "group"], _nbytes())


def test_the_source_hears_of_the_bytes_as_they_are_read():
    """A slow read (~2.6 s): the source's progress moves every 256 KiB read (1.9 MB: 7 times
    and the two parts' last answers), not once a part."""
    same, routes, _, times = _run(may_read=True, how="slow")
    assert same and routes == ["memory", "memory"]
    assert times >= 7


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
