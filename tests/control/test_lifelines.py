"""Lifelines: a worker process's end, heard by the controller from its one TCP connection.

Real processes, real sockets: each holder is a Python process that connects with
:func:`planaria.wire.lifeline.hold` and forks a child (as a data loader does) before it is
SIGKILLed; the child lives on and must not keep the lifeline open."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import time

import pytest

from planaria.wire import lifeline
from planaria.wire.lifeline import Lifelines

HOLDER = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("lifeline", sys.argv[3])  # stdlib only: no torch
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
assert mod.hold(sys.argv[1], sys.argv[2]) is not None
child = os.fork()
if child == 0:
    time.sleep(600)  # a loader process: outlives its parent's SIGKILL
    os._exit(0)
print(child, flush=True)
time.sleep(600)
"""


class Heard:
    """A watcher: the names it was told of, in order."""

    def __init__(self) -> None:
        self.names: queue.SimpleQueue[str] = queue.SimpleQueue()

    def process_ended(self, name: str) -> None:
        self.names.put(name)

    def drained(self) -> list[str]:
        out = []
        while not self.names.empty():
            out.append(self.names.get_nowait())
        return out


class Holder:
    """A process holding the lifeline ``name``, and the child it forked."""

    def __init__(self, lifelines: Lifelines, name: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, lifelines.address, name,
                                      lifeline.__file__],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.child = int(self.proc.stdout.readline())  # after hold() returned
        end = time.monotonic() + 30
        while not lifelines.connected(name):  # its name line read by the listener's thread
            assert time.monotonic() < end, f"{name} never connected"
            time.sleep(0.005)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self) -> None:
        for pid in (self.proc.pid, self.child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture
def lifelines():
    lines = Lifelines("127.0.0.1")
    yield lines
    lines.close()


def test_a_killed_process_is_heard_of_at_once_though_the_child_it_forked_lives_on(lifelines):
    heard = Heard()
    lifelines.watch(heard, ["w0"])
    holder = Holder(lifelines, "w0")
    try:
        assert lifelines.ended_at("w0") is None
        t0 = time.time()
        holder.kill()
        assert heard.names.get(timeout=30) == "w0"
        os.kill(holder.child, 0)  # alive, holding a copy of every fd but the lifeline
        ended = lifelines.ended_at("w0")
        assert ended is not None and ended >= t0
        assert not lifelines.connected("w0")
    finally:
        holder.close()


def test_a_watcher_hears_at_once_of_the_names_it_watches_whose_lifeline_ended_already(
        lifelines):
    holder = Holder(lifelines, "w1")
    early = Heard()
    lifelines.watch(early, [])
    try:
        holder.kill()
        assert early.names.get(timeout=30) == "w1"
        late = Heard()
        lifelines.watch(late, ["w1", "w9"])  # w9 never connected: nothing said of it
        assert late.drained() == ["w1"]
        lifelines.unwatch(late)
    finally:
        holder.close()


def test_a_start_retried_under_a_name_owns_it_and_the_older_process_end_is_not_reported(
        lifelines):
    heard = Heard()
    lifelines.watch(heard, [])
    older = Holder(lifelines, "w3")
    newer = Holder(lifelines, "w3")  # the same name started again: the newest lifeline
    marker = None
    try:
        older.kill()
        # Its end is read before the marker's (readable before the marker even connects).
        marker = Holder(lifelines, "w5")
        marker.kill()
        assert heard.names.get(timeout=30) == "w5"
        assert heard.drained() == []  # the older w3's end was not reported
        assert lifelines.connected("w3") and lifelines.ended_at("w3") is None
        newer.kill()
        assert heard.names.get(timeout=30) == "w3"
    finally:
        for h in (older, newer, marker):
            if h is not None:
                h.close()


def test_a_connection_that_is_not_a_worker_is_dropped_without_a_report(lifelines):
    import socket

    heard = Heard()
    lifelines.watch(heard, [])
    host, _, port = lifelines.address.rpartition(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"x" * 300)  # no name line within 256 bytes: refused
        assert sock.recv(1) == b""  # closed by the listener
    holder = Holder(lifelines, "w6")
    try:
        holder.kill()
        assert heard.names.get(timeout=30) == "w6"
        assert heard.drained() == []
    finally:
        holder.close()


def test_a_process_that_cannot_reach_the_listener_goes_on_without_one():
    from planaria.wire.lifeline import hold

    lines = Lifelines("127.0.0.1")
    lines.close()  # nothing listens on its address now
    assert hold(lines.address, "w0") is None
