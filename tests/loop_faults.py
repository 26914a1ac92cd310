"""Faults a test arms at a worker's fault points (``worker.loaded``, ``worker.computed``,
``worker.reduced``, ``worker.applied``, ``worker.eval_batch``, ``worker.shard_write``:
:data:`planaria.faults.points.WORKER_POINTS`), sent to the workers by value (the workers
cannot import the tests package).

A loop fault here is ``hook(worker, step, phase)`` (``phase``: the point's name without
``worker.``); :func:`install` arms it at every worker point of one worker."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import ray

from planaria.faults.points import WORKER_POINTS


class SignalSelfAt:
    """At ``step``, in ``phase`` of this worker's loop: send this worker ``signum`` (once)."""

    def __init__(self, step: int, phase: str, signum: int, marker: str) -> None:
        self.step, self.phase, self.signum, self.marker = step, phase, signum, marker

    def __call__(self, worker: Any, step: int, phase: str) -> None:
        if phase == self.phase and step == self.step and not os.path.exists(self.marker):
            Path(self.marker).write_text(worker.name)
            os.kill(os.getpid(), self.signum)


class AtPhase:
    """A point's action that calls ``hook(worker, step, phase)``."""

    def __init__(self, hook: Any, phase: str) -> None:
        self.hook, self.phase = hook, phase

    def __call__(self, *, worker: Any, step: int, **context: Any) -> None:
        self.hook(worker, step, self.phase)  # context: a point's more (an eval batch's index)


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

LOOP_POINTS = [p for p in WORKER_POINTS if p not in ("worker.shard_write", "worker.stage_copy")]
"""The points of a worker's step loop (a save's copy and write run on threads of their own)."""


def arm(job: Any, worker: str, point: str, action: Any, *, times: int | None = None) -> None:
    """Arms ``point`` of ``worker`` with ``action``: a replica's leader (``w1``) or another of
    its workers (``w1.1``, reached through its leader, which owns it)."""
    leader, _, index = worker.partition(".")
    handle = next(h for h in job.members if h.name == leader)
    ray.get(handle.actor.arm_fault.remote(point, action, times=times, shard=int(index or 0)))


def install(job: Any, name: str, hook: Any) -> None:
    """Arms every point of worker ``name``'s loop with ``hook(worker, step, phase)``."""
    for point in LOOP_POINTS:
        arm(job, name, point, AtPhase(hook, point.removeprefix("worker.")))


class DieLeavingSocketsOpen:
    """At ``step``, once its gradient is computed (before the all-reduce): this worker dies
    by SIGKILL, but a child it forked just before holds its sockets open, so its peers'
    transport sees no closed connection (as when a dead process's descriptors outlive it).
    The child exits after ``linger_s``. A Python fork closes the child's copy of the
    worker's lifeline (planaria.wire.lifeline); with ``lifeline_too`` the child holds a
    duplicate of it as well, as a fork made by a C library would."""

    def __init__(self, step: int, marker: str, linger_s: float = 120.0, *,
                 lifeline_too: bool = False) -> None:
        self.step, self.marker, self.linger_s = step, marker, linger_s
        self.lifeline_too = lifeline_too

    def __call__(self, worker: Any, step: int, phase: str) -> None:
        if phase == "computed" and step == self.step and not os.path.exists(self.marker):
            Path(self.marker).write_text(worker.name)
            if self.lifeline_too:
                from planaria.wire import lifeline

                assert lifeline._held, "the worker holds no lifeline"
                for sock in lifeline._held:  # duplicates the fork hook does not know of
                    os.dup(sock.fileno())
            ready_r, ready_w = os.pipe()
            if os.fork() == 0:  # the child only sleeps: nothing of the parent's state runs
                # A session of its own before the parent dies: the fork server kills what is
                # left of a dead worker's process group (its memory holder).
                os.setsid()
                os.write(ready_w, b"x")
                import time

                time.sleep(self.linger_s)
                os._exit(0)
            os.read(ready_r, 1)
            os.kill(os.getpid(), 9)
