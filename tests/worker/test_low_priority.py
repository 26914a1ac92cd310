"""A joiner's setup at a lower CPU priority: on a thread of its own, the caller's kept; its
warm-up on the calling thread, lowered for the block and put back after."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from planaria.worker.forkserver import may_raise_priority
from planaria.worker.low_priority import lowered_here, run_at_priority, thread_priority

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority")


@linux_only
def test_lowest_runs_at_nice_19_and_the_caller_keeps_its_priority() -> None:
    before = thread_priority()
    tid, seen = run_at_priority(lambda: (threading.get_native_id(), thread_priority()),
                                "lowest")
    assert tid != threading.get_native_id()
    assert seen == "nice 19"
    assert thread_priority() == before


@linux_only
def test_idle_runs_under_sched_idle() -> None:
    policy = run_at_priority(lambda: os.sched_getscheduler(threading.get_native_id()), "idle")
    assert policy == os.SCHED_IDLE
    assert run_at_priority(thread_priority, "idle") == "idle"
    assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_IDLE


def test_its_error_is_raised_to_the_caller() -> None:
    def fails() -> None:
        raise ValueError("bad factory")

    with pytest.raises(ValueError, match="bad factory"):
        run_at_priority(fails, "idle")


def test_worker_runs_on_the_calling_thread() -> None:
    assert run_at_priority(threading.get_native_id, "worker") == threading.get_native_id()


def test_an_unknown_priority_is_refused() -> None:
    with pytest.raises(ValueError, match="one of worker, lowest, idle"):
        run_at_priority(lambda: None, "high")


may_raise = pytest.mark.skipif(not sys.platform.startswith("linux") or not may_raise_priority(),
                               reason="putting a priority back needs root or RLIMIT_NICE")


def _policy(tid: int) -> tuple[int, int]:
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


@may_raise
@pytest.mark.parametrize(("priority", "seen"), [("idle", "idle"), ("lowest", "nice 19")])
def test_lowered_here_runs_on_this_thread_and_puts_it_back(priority: str, seen: str) -> None:
    tid = threading.get_native_id()
    before = _policy(tid)
    with lowered_here(priority, may_raise=True) as ran_at:
        assert (ran_at, thread_priority()) == (priority, seen)
        assert threading.get_native_id() == tid
    assert _policy(tid) == before


@may_raise
def test_a_thread_started_in_the_block_is_put_back_too() -> None:
    """torch's intra-op threads are made on first use and inherit the priority."""
    before = _policy(threading.get_native_id())
    started: list[int] = []
    running, release = threading.Event(), threading.Event()

    def body() -> None:
        started.append(threading.get_native_id())
        running.set()
        release.wait()

    with lowered_here("idle", may_raise=True):
        thread = threading.Thread(target=body)
        thread.start()
        running.wait()
        assert os.sched_getscheduler(started[0]) == os.SCHED_IDLE
    try:
        assert _policy(started[0]) == before
    finally:
        release.set()
        thread.join()


@may_raise
def test_an_error_in_the_block_still_puts_the_priority_back() -> None:
    before = _policy(threading.get_native_id())
    with pytest.raises(ValueError, match="bad warm-up"), lowered_here("idle", may_raise=True):
        raise ValueError("bad warm-up")
    assert _policy(threading.get_native_id()) == before


def test_without_leave_to_raise_it_back_the_block_runs_at_the_callers_priority() -> None:
    before = thread_priority()
    with lowered_here("idle", may_raise=False) as ran_at:
        assert (ran_at, thread_priority()) == ("worker", before)
    with pytest.raises(ValueError, match="one of worker, lowest, idle"), \
            lowered_here("high", may_raise=True):
        pass
