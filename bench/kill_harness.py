"""One seeded kill harness for every system a fault benchmark compares (``bench/goodput.py``).

The harness lives in the bench process, outside every system under test, and
kills the same way whatever it kills:

- the **schedule** is drawn once from ``--seed``: kill ``i`` (1, 2, ...) is due
  ``i * every_s`` after the measured window opens, moved by a seeded jitter of
  up to ``jitter`` of ``every_s`` either way; kills due after
  ``duration_s - every_s / 2`` are left out (a kill needs time to show its
  recovery inside the window). Every system gets the same schedule;
- at a kill's time the harness asks the system's runner for its **active
  training workers** (``victims()``: name and pid; never a standby spare, a
  lighthouse, torchrun's agent or Ray's own processes) and picks one with the kill's
  seeded draw (``pick`` in [0, 1) indexes the workers sorted by name). If none
  is active (the system is still restarting) it waits for one, until the next
  kill is due (then the kill is recorded as skipped);
- it then waits a seeded fraction (``step_fraction``) of the system's step time
  (``step_s()``, the runner's estimate) so the SIGKILL lands at a random point
  of a step, checks the victim still runs, and sends SIGKILL from outside;
- each kill is recorded: ``t_kill`` (``time.time()`` right after the signal),
  ``pid``, ``worker``, ``planned_t``, ``step_fraction``.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "JsonlTail",
    "KillHarness",
    "PlannedKill",
    "Victim",
    "pid_alive",
    "plan_kills",
    "step_period_s",
]

_POLL_S = 0.05


@dataclass(frozen=True)
class Victim:
    """An active training worker of the system under test."""

    name: str
    pid: int


@dataclass(frozen=True)
class PlannedKill:
    """One kill of the seeded schedule (the same for every system)."""

    at_s: float
    """Seconds after the window opens."""
    pick: float
    """In [0, 1): which of the active workers (sorted by name) is killed."""
    step_fraction: float
    """In [0, 1): how far into a step (of the system's step time) the signal is sent."""


def plan_kills(seed: int, every_s: float, duration_s: float, jitter: float = 0.25
               ) -> list[PlannedKill]:
    """The seeded schedule of a window of ``duration_s`` (see the module docstring)."""
    rng = random.Random(seed)
    plan: list[PlannedKill] = []
    i = 1
    while True:
        at = i * every_s + rng.uniform(-jitter, jitter) * every_s
        pick, fraction = rng.random(), rng.random()
        if at > duration_s - every_s / 2:
            return plan
        plan.append(PlannedKill(at_s=at, pick=pick, step_fraction=fraction))
        i += 1


def pid_alive(pid: int) -> bool:
    """The process runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class KillHarness:
    """Sends the planned SIGKILLs to one system from a background thread."""

    def __init__(self, plan: list[PlannedKill]) -> None:
        self.plan = list(plan)
        self.kills: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0: float | None = None

    def start(self, t0: float, victims: Callable[[], list[Victim]],
              step_s: Callable[[], float | None]) -> None:
        """Starts killing on the schedule, times counted from ``t0`` (the window's start)."""
        self.t0 = t0
        self._thread = threading.Thread(
            target=self._run, args=(t0, victims, step_s), name="kill-harness", daemon=True
        )
        self._thread.start()

    def stop(self) -> list[dict[str, Any]]:
        """Stops the thread (no kill is sent after this returns); the kills sent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        return self.kills

    def _run(self, t0: float, victims: Callable[[], list[Victim]],
             step_s: Callable[[], float | None]) -> None:
        for i, planned in enumerate(self.plan):
            due = t0 + planned.at_s
            next_due = t0 + self.plan[i + 1].at_s if i + 1 < len(self.plan) else float("inf")
            if self._stop.wait(max(0.0, due - time.time())):
                return  # the window closed before this kill was due
            self._kill_one(planned, due, next_due, victims, step_s)
            if self._stop.is_set():
                return

    def _kill_one(self, planned: PlannedKill, due: float, next_due: float,
                  victims: Callable[[], list[Victim]],
                  step_s: Callable[[], float | None]) -> None:
        while not self._stop.is_set() and time.time() < next_due:
            active = sorted((v for v in victims() if pid_alive(v.pid)), key=lambda v: v.name)
            if active:
                victim = active[int(planned.pick * len(active))]
                # A random point in the step: the schedule ignores step phases, and this
                # seeded offset makes it explicit.
                if self._stop.wait(planned.step_fraction * (step_s() or 0.0)):
                    break
                if not pid_alive(victim.pid):
                    continue  # it died meanwhile (another fault): pick again
                try:
                    os.kill(victim.pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.kills.append({"t_kill": time.time(), "pid": victim.pid,
                                   "worker": victim.name, "planned_t": due, **asdict(planned)})
                return
            self._stop.wait(_POLL_S)
        why = "the window closed" if self._stop.is_set() else "the next kill was due"
        self.skipped.append({"planned_t": due, "why": f"no active worker until {why}"})


class JsonlTail:
    """The records of a JSON-lines file that another process appends to, read incrementally
    (each call parses only the new bytes; a torn last line waits for its end)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.rows
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # not a record (garbage); the log's readers skip it too
            if isinstance(row, dict):
                self.rows.append(row)
        return self.rows


def step_period_s(commits: list[tuple[int, float]], last: int = 50) -> float | None:
    """The median time between commits of consecutive steps among the ``last`` most recent
    ``(step, wall)`` commits: the harness's estimate of a system's step time."""
    recent = sorted(commits, key=lambda c: c[1])[-last:]
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(recent) if b[0] == a[0] + 1]
    return statistics.median(gaps) if gaps else None
