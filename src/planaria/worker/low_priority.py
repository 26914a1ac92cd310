"""Work off the critical path at a lower CPU priority: a joiner's setup beside training.

A replacement or spare often starts on cores that training workers are using (a
node with a free slot, a spare beside its peers, a test machine). Its setup (the
model's build, a forward and backward, the optimizer's state: a few CPU-seconds)
then slows every survivor's step, and the step is the job's. At a lower priority
it takes the CPU the survivors leave (their waits in the reduction, for data); on
a node of its own nothing competes and it runs at full speed.

Two levels below the worker's own (:data:`PRIORITIES`): ``"lowest"``, nice 19
(CFS gives it a weight of 15 against a nice-0 thread's 1024 and a Ray worker's,
nice 15 by Ray's default, 36), and ``"idle"``, Linux's ``SCHED_IDLE`` policy
(weight 3: it runs when no other thread of the machine wants the core).

Linux keeps a priority per thread, so the work runs on a thread of its own whose
priority is lowered: the caller's threads keep theirs (an unprivileged process may
lower a priority but not raise it back). Threads the work starts inherit the lower
priority; none outlives it here (a worker runs ``torch`` on one thread, and its
collective threads start at the join, later).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from planaria.config import SETUP_PRIORITIES

__all__ = ["PRIORITIES", "lowered_here", "run_at_priority", "thread_priority"]

PRIORITIES = SETUP_PRIORITIES
"""``worker``: the worker's own; ``lowest``: nice 19; ``idle``: ``SCHED_IDLE``."""

T = TypeVar("T")

_LINUX = sys.platform.startswith("linux")


def _lower(priority: str) -> None:
    tid = threading.get_native_id()
    if priority == "idle":
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.setpriority(os.PRIO_PROCESS, tid, 19)


def run_at_priority(fn: Callable[[], T], priority: str) -> T:
    """Runs ``fn`` at ``priority`` (one of :data:`PRIORITIES`) and returns its result, or
    raises its exception, on the calling thread.

    Below ``"worker"`` it runs on a new thread whose priority is lowered (the caller's
    is kept). ``"worker"``, or a platform without per-thread priorities (only Linux has
    them): on the calling thread. Thread-local state (torch's grad mode, autocast)
    starts at its defaults on a new thread, as on any thread.
    """
    if priority not in PRIORITIES:
        raise ValueError(f"priority {priority!r}: one of {', '.join(PRIORITIES)}")
    if priority == "worker" or not _LINUX:
        return fn()
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        with contextlib.suppress(OSError):  # forbidden (a sandbox): the caller's priority
            _lower(priority)
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=body, name="planaria-lower-priority", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _own_tasks() -> set[int]:
    try:
        return {int(task) for task in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _put_back(tid: int, policy: int, nice: int) -> None:
    with contextlib.suppress(OSError):  # a thread that ended meanwhile
        if os.sched_getscheduler(tid) != policy:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        if os.getpriority(os.PRIO_PROCESS, tid) != nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)


@contextlib.contextmanager
def lowered_here(priority: str, *, may_raise: bool) -> Iterator[str]:
    """Runs the block on the calling thread at ``priority``, then puts the thread's policy
    and nice value back, and those of threads the block started (they inherited the lower
    priority: torch's intra-op pool, made on first use, outlives the block). Yields the
    priority the block ran at.

    For work whose thread matters: a CPU allocator keeps memory per thread (glibc's
    arenas), so a joiner's warm-up touches its steps' memory on the steps' own thread.
    Putting a priority back raises it, which needs ``may_raise`` (root, ``CAP_SYS_NICE``
    or an ``RLIMIT_NICE`` that covers it: planaria.worker.forkserver.may_raise_priority);
    without it, or at ``"worker"``, or off Linux, the block runs at the caller's priority
    (yields ``"worker"``).
    """
    if priority not in PRIORITIES:
        raise ValueError(f"priority {priority!r}: one of {', '.join(PRIORITIES)}")
    if priority == "worker" or not _LINUX or not may_raise:
        yield "worker"
        return
    tid = threading.get_native_id()
    policy, nice = os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)
    before = _own_tasks()
    try:
        _lower(priority)
    except OSError:  # forbidden (a sandbox): the block runs at the caller's priority
        priority = "worker"
    try:
        yield priority
    finally:  # where nothing was lowered, nothing differs and nothing is set
        _put_back(tid, policy, nice)
        for started in _own_tasks() - before:
            _put_back(started, policy, nice)


def thread_priority() -> str:
    """The calling thread's priority: ``"idle"`` (``SCHED_IDLE``) or ``"nice N"``."""
    if not _LINUX:
        return "nice 0"
    tid = threading.get_native_id()
    if os.sched_getscheduler(tid) == os.SCHED_IDLE:
        return "idle"
    return f"nice {os.getpriority(os.PRIO_PROCESS, tid)}"
