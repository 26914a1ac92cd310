"""The job's phase hooks: the fault campaign's injector (and chaos) act on a job at its
boundaries, joins, saves and restores, and say which boundaries they need. A fault at a
place inside a part is armed at a named fault point instead (:mod:`planaria.faults.points`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["FaultHooks"]


class FaultHooks:
    """Calls each hook as ``hook(subject, phase, **info)`` (``subject``: the job).

    Phases: ``boundary`` (a step boundary begins), ``join`` (state transfer to joiners in
    flight), ``save`` (checkpoint writers started), ``restore`` (a restore's reads in
    flight). A hook with a ``next_step(after) -> int | None`` method is called at the
    boundaries it names (and wherever the job has one anyway); one without is called at
    every step (the job then runs one step at a time).
    """

    def __init__(self, subject: object) -> None:
        self.subject = subject
        self.hooks: list[Callable[..., None]] = []

    def call(self, phase: str, **info: Any) -> None:
        for hook in self.hooks:
            hook(self.subject, phase, **info)

    def next_step(self, start: int) -> int | None:
        """The earliest boundary after ``start`` a hook needs (None: none needs one)."""
        stop: int | None = None
        for hook in self.hooks:  # a hook without next_step needs every boundary
            planned = hook.next_step(start) if hasattr(hook, "next_step") else start + 1
            if planned is not None:
                stop = planned if stop is None else min(stop, planned)
        return stop
