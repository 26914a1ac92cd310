"""Faults a test installs in a worker's loop (``worker.loop_fault``), sent to the workers by
value (the workers cannot import the tests package)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import ray


class SignalSelfAt:
    """At ``step``, in ``phase`` of this worker's loop: send this worker ``signum`` (once)."""

    def __init__(self, step: int, phase: str, signum: int, marker: str) -> None:
        self.step, self.phase, self.signum, self.marker = step, phase, signum, marker

    def __call__(self, worker: Any, step: int, phase: str) -> None:
        if phase == self.phase and step == self.step and not os.path.exists(self.marker):
            Path(self.marker).write_text(worker.name)
            os.kill(os.getpid(), self.signum)


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def install(job: Any, name: str, hook: Any) -> None:
    """Sets worker ``name``'s ``loop_fault`` to ``hook`` (sent by value)."""
    handle = next(h for h in job.members if h.name == name)
    ray.get(handle.actor.__ray_call__.remote(lambda self: setattr(self, "loop_fault", hook)))


class DieLeavingSocketsOpen:
    """At ``step``, once its gradient is computed (before the all-reduce): this worker dies
    by SIGKILL, but a child it forked just before holds its sockets open, so its peers'
    transport sees no closed connection (as when a dead process's descriptors outlive it).
    The child exits after ``linger_s``."""

    def __init__(self, step: int, marker: str, linger_s: float = 120.0) -> None:
        self.step, self.marker, self.linger_s = step, marker, linger_s

    def __call__(self, worker: Any, step: int, phase: str) -> None:
        if phase == "computed" and step == self.step and not os.path.exists(self.marker):
            Path(self.marker).write_text(worker.name)
            if os.fork() == 0:  # the child only sleeps: nothing of the parent's state runs
                os.setsid()
                import time

                time.sleep(self.linger_s)
                os._exit(0)
            os.kill(os.getpid(), 9)
