"""Chaos, injected: the chaos plan's faults sent to the members' processes when due."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from planaria.faults.chaos import send_signal

if TYPE_CHECKING:
    from planaria.control.departures import FaultTimes
    from planaria.control.protocols import Roster
    from planaria.control.watchdog import StepDeadline
    from planaria.faults.chaos import ChaosPlan
    from planaria.observe.events import EventLog

__all__ = ["ChaosInjector"]

_log = logging.getLogger("planaria.commits")


class ChaosInjector:
    """Sends a :class:`~planaria.faults.chaos.ChaosPlan`'s faults: those planned by time at a
    boundary, those planned for a step inside it. Each fault's time is kept in
    ``fault_times`` (its recovery is measured from it)."""

    def __init__(self, *, plan: ChaosPlan, roster: Roster, fault_times: FaultTimes,
                 log: EventLog, deadline: StepDeadline, elapsed_s: Callable[[], float]) -> None:
        self.plan = plan
        self.roster = roster
        self.fault_times = fault_times
        self.log = log
        self.deadline = deadline
        self.elapsed_s = elapsed_s

    def by_time(self, step: int) -> None:
        """The faults planned by time that are due (at a boundary, at ``step``)."""
        self._inject([(ev.action, ev.target) for ev in
                      self.plan.due(step=None, elapsed_s=self.elapsed_s()) if ev.step is None],
                     step)

    def during_step(self, step: int) -> None:
        """The faults due while ``step`` runs (called right after its dispatch)."""
        due = self.plan.due(step=step, elapsed_s=self.elapsed_s())
        if any(ev.step is not None for ev in due):
            # Land inside the step: after dispatch, about a third of a typical step in; the
            # faults planned for one step land together.
            typical = self.deadline.typical_step_s or 0.05
            time.sleep(min(0.5, typical / 3))
        self._inject([(ev.action, ev.target) for ev in due], step)

    def _inject(self, faults: list[tuple[str, str]], step: int) -> None:
        """Sends the (action, target) faults' signals back to back, then logs them: faults
        planned together land together (a survivor of the first must not have answered
        before the next lands, or a whole-job loss would read as one worker's)."""
        sent = []
        for action, target in faults:
            name = self.plan.pick(target, self.roster.names)
            handle = next((h for h in self.roster.members if h.name == name), None)
            if handle is None or handle.pid is None:
                _log.warning("chaos %s:%s skipped: no such live worker", action, target)
                continue
            self.fault_times.caused[handle.name] = time.time()
            send_signal(action, handle.pid, slow_s=self.plan.slow_s)
            sent.append((action, handle))
        for action, handle in sent:
            self.log.emit("chaos", action=action, worker=handle.name, pid=handle.pid, step=step)
