"""A joiner's setup at a lower CPU priority: on a thread of its own, the caller's kept."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from planaria.worker.low_priority import run_at_priority, thread_priority

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
