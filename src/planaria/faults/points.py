"""Named fault points: the places where tests and the fault campaign act on a running job.

The code says where it can be acted on, ``points.hit("membership.commit_all", ...)``; a
test or the campaign says what happens there, ``points.arm(name, action)`` (raise, kill a
worker, sleep, drop a notice, ...), instead of monkeypatching planaria's classes. A point
nothing is armed at costs one dict lookup. The names are :data:`POINTS`, each with what
it means and the context its action is called with (as keyword arguments); arming an
unknown name is an error, and a test checks that every ``hit`` in the code names one.

The controller's points live in this process's registry (:func:`arm`, :func:`armed`); a
worker has a registry of its own (:class:`FaultPoints` over :data:`WORKER_POINTS`),
armed through the actor's ``arm_fault`` remote method. An action's return value is
what ``hit`` returns: the points that say so skip what they guard when it is
:data:`SKIP`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = [
    "CONTROLLER_POINTS",
    "POINTS",
    "SKIP",
    "WORKER_POINTS",
    "Action",
    "FaultPoints",
    "arm",
    "armed",
    "controller",
    "disarm",
    "hit",
]

Action = Callable[..., Any]
"""What runs at an armed point, called with the point's context as keyword arguments."""

SKIP = object()
"""Returned by an action at a point that can be skipped: what the point guards is not done."""

CONTROLLER_POINTS: Mapping[str, str] = MappingProxyType({
    "membership.commit_all":
        "before the members are told to apply the committed steps (membership)",
    "membership.send_state":
        "before a survivor sends the state to the joiners (membership, joiners: their ranks)",
    "recovery.admit":
        "before ready replacements are admitted into the next generation (recovery, ready)",
    "notices.holders_stay":
        "the last holders of the state got a notice while joiners still receive it: they "
        "stay to a later boundary (holders)",
    "checkpoint.save_started":
        "after a save's snapshot is taken and its writes started (step, reason)",
    "checkpoint.before_commit": "before a written checkpoint is committed (step)",
    "checkpoint.manifest_written": "a commit wrote the manifest, not the marker yet (step)",
    "checkpoint.marker_written":
        "a commit wrote the marker in the save's directory, before the rename (step)",
    "checkpoint.renamed":
        "a commit on local disk renamed a directory (the step's old one aside, or its new one "
        "into place) (step)",
    "checkpoint.after_commit": "after a checkpoint is committed (step, path)",
    "calls.notice":
        "a call's completion notice from Ray, before it is queued (ref, future: done, with "
        "the call's result or error); SKIP drops it, as if it had never come (on Ray's "
        "callback thread)",
    "calls.wait_reported":
        "a long wait has just said whom it waits for (names, step, waited_s, liveness)",
})
"""The controller's points: name -> when it is hit (its action's context)."""

WORKER_POINTS: Mapping[str, str] = MappingProxyType({
    "worker.loaded": "a step's samples are loaded, before its compute (worker, step)",
    "worker.computed": "a step's gradient is computed, before its reduction (worker, step)",
    "worker.reduced": "in a run, a step is reduced, before it is applied (worker, step)",
    "worker.applied": "in a run, a step is applied (worker, step)",
    "worker.shard_write":
        "a checkpoint shard's write begins, on the worker's writer thread (worker, step)",
    "worker.stage_copy":
        "a checkpoint's copy into staging begins, on the thread that copies: the staging "
        "thread when the copy runs beside the steps (worker, step)",
    "worker.state_sending":
        "a state sent beside the steps: the model's tensors are sent, the rest not yet, on "
        "the sending thread (worker, step: the steps done)",
    "worker.state_receiving":
        "a state received beside the steps: the model's tensors are in, the rest not yet, "
        "on the receiving thread (worker, step: the steps done)",
    "worker.eval_batch": "an evaluation's batch, before it runs (worker, step: the steps "
                         "committed, batch: its index in the eval set)",
})
"""A worker's points (``worker``: the worker actor): name -> when it is hit."""

POINTS: Mapping[str, str] = MappingProxyType({**CONTROLLER_POINTS, **WORKER_POINTS})
"""Every fault point: name -> when it is hit (its action's context)."""


@dataclass
class _Armed:
    action: Action
    times: int | None  # runs left; None: every hit


class FaultPoints:
    """A registry of armed points over ``names``; ``context`` is passed to every action
    beside what the point's ``hit`` passes. Safe to arm from another thread than the one
    that hits. ``armed`` is empty when nothing is: a hot path tests it before calling
    :meth:`hit` (one truth test, no call)."""

    __slots__ = ("_lock", "armed", "context", "names")

    def __init__(self, names: Mapping[str, str] = POINTS, **context: Any) -> None:
        self.names = names
        self.context = context
        self.armed: dict[str, _Armed] = {}
        self._lock = threading.Lock()

    def arm(self, name: str, action: Action, *, times: int | None = None) -> None:
        """``action`` runs at every hit of ``name`` (its first ``times`` hits, then the point
        is disarmed); replaces what was armed there."""
        if name not in self.names:
            raise KeyError(f"no fault point {name!r}; the points are: {', '.join(self.names)}")
        if times is not None and times < 1:
            raise ValueError(f"times must be at least 1, not {times}")
        self.armed[name] = _Armed(action, times)

    def disarm(self, name: str | None = None) -> None:
        """Disarms ``name`` (every point if None)."""
        if name is None:
            self.armed.clear()
        else:
            self.armed.pop(name, None)

    def hit(self, name: str, **context: Any) -> Any:
        """Runs what is armed at ``name`` (returning what it returns), else nothing."""
        armed = self.armed.get(name)
        if armed is None:
            return None
        if armed.times is not None:
            with self._lock:
                if self.armed.get(name) is not armed:
                    return None  # its last run was taken by another thread
                armed.times -= 1
                if armed.times == 0:
                    del self.armed[name]
        return armed.action(**self.context, **context)


controller = FaultPoints(CONTROLLER_POINTS)
"""This process's registry of the controller's points."""


def hit(name: str, **context: Any) -> Any:
    """Runs what is armed at the controller's point ``name``; one dict lookup when nothing is."""
    armed = controller.armed.get(name)
    return None if armed is None else controller.hit(name, **context)


def arm(name: str, action: Action, *, times: int | None = None) -> None:
    """Arms the controller's point ``name`` (see :meth:`FaultPoints.arm`)."""
    controller.arm(name, action, times=times)


def disarm(name: str | None = None) -> None:
    """Disarms the controller's point ``name`` (every one if None)."""
    controller.disarm(name)


@contextlib.contextmanager
def armed(name: str, action: Action, *, times: int | None = None) -> Iterator[None]:
    """The controller's point ``name`` armed with ``action`` for the ``with`` block only."""
    controller.arm(name, action, times=times)
    try:
        yield
    finally:
        controller.disarm(name)
