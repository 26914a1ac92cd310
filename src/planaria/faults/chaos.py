"""Chaos injection: real signals to real worker processes, on a plan.

A plan is a comma-separated list of ``ACTION:TARGET@WHEN``:

- ACTION: ``kill`` (SIGKILL), ``hang`` (SIGSTOP), ``preempt`` (SIGTERM), or
  ``slow`` (a straggler: SIGSTOP/SIGCONT at a 50% duty cycle for a while);
- TARGET: ``w<N>`` (the N-th worker started) or ``random`` (a live worker, seeded);
- WHEN: ``step<N>`` (while step N runs), ``<N>s`` (N seconds after the start),
  or ``poisson<N>s`` (random faults with that mean interval, seeded).

Example: ``kill:w1@step40,hang:w0@step90,preempt:w2@step120``.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass, field

from planaria.faults.errors import ConfigError

__all__ = ["ChaosEvent", "ChaosPlan", "send_signal"]

ACTIONS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "preempt": signal.SIGTERM, "slow": None}
_EVENT = re.compile(
    r"^(?P<action>[a-z]+):(?P<target>w\d+|random)@"
    r"(?:step(?P<step>\d+)|poisson(?P<mean>\d+(?:\.\d+)?)s|(?P<secs>\d+(?:\.\d+)?)s)$"
)


@dataclass(frozen=True)
class ChaosEvent:
    """One planned fault."""

    action: str
    target: str
    step: int | None = None
    at_s: float | None = None
    poisson_mean_s: float | None = None

    def __str__(self) -> str:
        if self.step is not None:
            when = f"step{self.step}"
        elif self.poisson_mean_s is not None:
            when = f"poisson{self.poisson_mean_s:g}s"
        else:
            when = f"{self.at_s:g}s"
        return f"{self.action}:{self.target}@{when}"


@dataclass
class ChaosPlan:
    """A parsed chaos plan. The controller asks it what is due at each step and instant."""

    events: list[ChaosEvent] = field(default_factory=list)
    seed: int = 0
    slow_s: float = 10.0
    """How long a ``slow`` straggler lasts."""

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._next_poisson: dict[int, float] = {}
        self._fired: set[int] = set()

    @classmethod
    def parse(cls, text: str, *, seed: int = 0) -> ChaosPlan:
        events = []
        for raw in (p.strip() for p in text.split(",")):
            if not raw:
                continue
            m = _EVENT.match(raw)
            if m is None or m["action"] not in ACTIONS:
                raise ConfigError(
                    f"chaos event {raw!r} is not valid: use ACTION:TARGET@WHEN with ACTION one of "
                    f"{', '.join(ACTIONS)}, TARGET w<N> or random, WHEN step<N>, <N>s or "
                    "poisson<N>s (e.g. kill:w1@step40)"
                )
            events.append(
                ChaosEvent(
                    action=m["action"],
                    target=m["target"],
                    step=int(m["step"]) if m["step"] else None,
                    at_s=float(m["secs"]) if m["secs"] else None,
                    poisson_mean_s=float(m["mean"]) if m["mean"] else None,
                )
            )
        if not events:
            raise ConfigError(f"chaos plan {text!r} is empty: give at least one ACTION:TARGET@WHEN")
        return cls(events, seed=seed)

    def __str__(self) -> str:
        return ",".join(str(e) for e in self.events)

    def due(self, *, step: int | None, elapsed_s: float) -> list[ChaosEvent]:
        """Events due now: at this step's dispatch, or by this many seconds since the start."""
        out = []
        for i, ev in enumerate(self.events):
            if ev.poisson_mean_s is not None:
                nxt = self._next_poisson.get(i)
                if nxt is None:
                    nxt = self._next_poisson[i] = self._rng.expovariate(1 / ev.poisson_mean_s)
                if elapsed_s >= nxt:
                    out.append(ev)
                    self._next_poisson[i] = elapsed_s + self._rng.expovariate(1 / ev.poisson_mean_s)
                continue
            if i in self._fired:
                continue
            if (ev.step is not None and step is not None and step >= ev.step) or (
                ev.at_s is not None and elapsed_s >= ev.at_s
            ):
                self._fired.add(i)
                out.append(ev)
        return out

    def next_step(self, *, after: int) -> int | None:
        """The first step after ``after`` that an event not yet fired is planned for."""
        steps = [ev.step for i, ev in enumerate(self.events)
                 if ev.step is not None and i not in self._fired and ev.step > after]
        return min(steps, default=None)

    def time_due(self, elapsed_s: float) -> bool:
        """An event planned by time is due (without firing it: see :meth:`due`)."""
        for i, ev in enumerate(self.events):
            if ev.poisson_mean_s is not None:
                nxt = self._next_poisson.get(i)
                if nxt is not None and elapsed_s >= nxt:
                    return True
            elif ev.at_s is not None and i not in self._fired and elapsed_s >= ev.at_s:
                return True
        return False

    def pick(self, target: str, live: list[str]) -> str | None:
        """The worker an event hits: its named target if live, or a seeded random live one."""
        if target == "random":
            return self._rng.choice(sorted(live)) if live else None
        return target if target in live else None


def send_signal(action: str, pid: int, *, slow_s: float = 10.0) -> None:
    """Sends the action's real signal to ``pid`` (``slow`` starts a duty-cycle thread)."""
    if action == "slow":
        threading.Thread(target=_straggle, args=(pid, slow_s), daemon=True).start()
        return
    sig = ACTIONS[action]
    assert sig is not None
    os.kill(pid, sig)


def _straggle(pid: int, duration_s: float, period_s: float = 0.2) -> None:
    end = time.monotonic() + duration_s
    try:
        while time.monotonic() < end:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(period_s / 2)
            os.kill(pid, signal.SIGCONT)
            time.sleep(period_s / 2)
    except ProcessLookupError:
        return
