"""Workers on their way out, and when each fault happened: state several parts share.

:class:`Departures` is written where notices are read (:mod:`.boundary`) and where the
policy drains or evacuates (:mod:`planaria.control.recovery`), and read where calls are judged
(:mod:`.calls`). :class:`FaultTimes` is written where a fault is caused or found (chaos,
a notice, a hang) and read once when the fault is opened.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Departures", "FaultTimes"]


class Departures:
    """Members that got a preemption notice.

    ``draining``: they leave at a step boundary; ``evacuating``: every holder of the state
    got one, and they leave together once a save beside the steps is written;
    ``leave_now``: the wait in flight ends in a Preempted, whatever it got (read once).
    """

    def __init__(self) -> None:
        self.draining: set[str] = set()
        self.evacuating: tuple[str, ...] = ()
        self.leave_now = False


class FaultTimes:
    """When each fault happened, by worker: a chaos signal or a notice (``caused``), or
    when a stuck worker's work stopped moving (``stuck_since``); else its last heartbeat
    (``last_alive_t``: from the liveness, on the controller's clock)."""

    def __init__(self, last_alive_t: Callable[[str], float | None]) -> None:
        self.caused: dict[str, float] = {}
        self.stuck_since: dict[str, float] = {}
        self._last_alive_t = last_alive_t

    def fault_time(self, names: tuple[str, ...]) -> float:
        """Best estimate of when a fault happened: the chaos signal, else, from the faulty
        worker's own record, when its work stopped moving (a worker stuck with its heartbeat
        alive, or cut off from its peers) or the last heartbeat change the controller saw
        (on its own clock). Each time is used once."""
        times = [self.caused.pop(n) for n in names if n in self.caused]
        if times:
            return min(times)
        stuck = [self.stuck_since.pop(n) for n in names if n in self.stuck_since]
        if stuck:
            return min(stuck)
        beats = [t for t in (self._last_alive_t(n) for n in names) if t is not None]
        return min(beats) if beats else time.time()
