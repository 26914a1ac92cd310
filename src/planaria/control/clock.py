"""The controller's clock: where its timing decisions read time, so a test can set it."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["REAL_CLOCK", "Clock", "RealClock"]


class Clock(Protocol):
    """Time as a timing decision reads it. ``monotonic`` measures durations (never goes
    back); ``now`` dates what is reported (seconds since the epoch); ``sleep`` waits."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (only differences mean anything)."""

    def now(self) -> float:
        """Wall-clock seconds since the epoch."""

    def sleep(self, seconds: float) -> None:
        """Returns after ``seconds`` on this clock."""


class RealClock:
    """The host's clocks (``time.monotonic``, ``time.time``, ``time.sleep``)."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


REAL_CLOCK: Clock = RealClock()
"""The default everywhere a clock can be injected."""
