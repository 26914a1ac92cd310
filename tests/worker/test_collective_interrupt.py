"""A rank waiting in a collective leaves it when told to, whatever the transport notices.

The controller interrupts a generation's collectives when one of its workers failed
(Worker.abort). Here a real two-rank gloo group where rank 1 is alive but never
joins the all-reduce rank 0 waits in (as when a dead peer's connection stays open):
a wait longer than its slices still ends with the operation's result; rank 0's
wait ends on the interrupt, the abandoned group is released without
blocking, and every later wait on the group raises at once.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from planaria.faults.errors import StepAborted
from planaria.worker.collective import WAIT_SLICE_S, Collective

pytestmark = pytest.mark.multiprocess


def _rank(rank: int, port: int, q: mp.Queue) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
        comm = Collective(store, 0, rank, 2, join_timeout_s=30, timeout_s=60)
        x = torch.ones(1000)
        comm.allreduce_sum([x])  # the group works
        q.put(("sum", rank, float(x[0])))
        sums = []
        for k in range(12):  # a peer late by several wait slices, and by a slice's edges
            if rank == 1:
                time.sleep(WAIT_SLICE_S * (k / 4) + 0.001 * (k % 3))
            y = torch.ones(1000)
            comm.allreduce_sum([y])
            sums.append(float(y[0]))
        q.put(("late peer", rank, float(sum(sums))))
        if rank == 1:
            time.sleep(20)  # alive, connections open, never in the next collective
            return
        threading.Timer(0.5, comm.interrupt).start()
        t0 = time.monotonic()
        try:
            comm.allreduce_sum([torch.ones(1000)])
            q.put(("not interrupted", 0, 0.0))
        except StepAborted:
            q.put(("interrupted", 0, time.monotonic() - t0))  # close() included
        t1 = time.monotonic()
        with pytest.raises(StepAborted):
            comm.wait_all([])  # the group is gone: every later wait raises at once
        q.put(("later", 0, time.monotonic() - t1))
    except Exception as err:  # reported to the test
        q.put(("error", rank, repr(err)))


def test_an_interrupt_ends_a_wait_whose_peer_never_comes():
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, store.port, q), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=60) for _ in range(6)]
    finally:
        for p in procs:
            p.kill()
    assert not [g for g in got if g[0] == "error"], got
    assert sorted(g[2] for g in got if g[0] == "sum") == [2.0, 2.0]
    assert [g[2] for g in got if g[0] == "late peer"] == [24.0, 24.0]  # every wait ended well
    waited = next(g[2] for g in got if g[0] == "interrupted")
    assert 0.4 < waited < 3.0  # the interrupt's 0.5 s, not the collective timeout's 60
    assert next(g[2] for g in got if g[0] == "later") < 0.5


def _rank_that_dies(rank: int, port: int, q: mp.Queue) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
        comm = Collective(store, 0, rank, 2, join_timeout_s=30, timeout_s=60)
        comm.allreduce_sum([torch.ones(10)])  # the group works
        if rank == 1:
            import os

            os._exit(0)  # dies: its sockets close
        side: list[BaseException] = []

        def receive() -> None:  # a transfer beside the step, from the peer that died
            try:
                comm.recv([torch.empty(10)], 1)
            except Exception as err:
                side.append(err)

        thread = threading.Thread(target=receive)
        thread.start()
        thread.join(30)
        q.put(("side", 0, type(side[0]).__name__ if side else "none"))
        try:
            comm.allreduce_sum([torch.ones(10)])  # the step's next collective
            q.put(("step", 0, "no error"))
        except StepAborted as err:
            q.put(("step", 0, f"StepAborted: {err}"))
        except Exception as err:
            q.put(("step", 0, f"{type(err).__name__}: {err}"))
    except Exception as err:  # reported to the test
        q.put(("error", rank, repr(err)))


def test_a_group_a_peers_death_closed_on_another_thread_aborts_the_step():
    """A transfer thread's operation fails on a dead peer and closes the group; the step's
    next collective on it is that failure's consequence (StepAborted), not a cause."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_that_dies, args=(r, store.port, q), daemon=True)
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {g[0]: g[2] for g in (q.get(timeout=60) for _ in range(2))}
    finally:
        for p in procs:
            p.kill()
    assert "error" not in got, got
    assert got["side"] == "RuntimeError"  # gloo: connection closed by peer
    assert got["step"].startswith(
        "StepAborted: the process group of generation 0 was closed after a peer failed"), got
