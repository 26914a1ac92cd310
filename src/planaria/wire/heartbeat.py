"""A worker's heartbeat record, and the thread that writes it: what the worker and the
controller's :mod:`planaria.control.liveness` share.

The worker's heartbeat thread (:func:`beat`) writes a :class:`Heartbeat` to
``hb/<name>`` in the controller's store every beat (unless its run commits steps: progress
is the heartbeat), looks at its fence, and tells a preemption notice at once; the
controller reads and judges the records (:class:`planaria.control.liveness.Liveness`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from planaria.wire import store_keys

__all__ = ["FENCE_CHECK_S", "GAP_WINDOW", "QUIET_S", "Heartbeat", "beat", "quiet_s"]

_log = logging.getLogger("planaria.wire.heartbeat")

FENCE_CHECK_S = 1.0
"""How often a worker's heartbeat thread looks at its fence (an evicted worker exits)."""

QUIET_S = 0.5
"""A worker whose run committed a step this recently skips its heartbeat write (at most, see
:func:`quiet_s`)."""


def quiet_s(heartbeat_s: float) -> float:
    """How long after a committed step a worker skips its beats: :data:`QUIET_S`, or two
    beats if shorter (a job tuned for fast detection keeps its records fresh)."""
    return min(QUIET_S, 2 * heartbeat_s)


@dataclass(frozen=True)
class Heartbeat:
    """A worker's last report: a beat counter, its phase, step, generation, notice, progress,
    what it works on, how often it was busy, and the longest gap between its beats (ms)."""

    beat: int
    phase: str
    step: int
    gen: int
    preempting: bool
    progress: int
    work: str = ""
    busy: int = 0
    gap_ms: int = 0

    @staticmethod
    def parse(raw: bytes) -> Heartbeat:
        parts = raw.decode().split("|")
        beat, phase, step, gen, pre, progress = parts[:6]
        work, busy, gap = [*parts[6:9], *("", "0", "0")[len(parts[6:9]):]]
        return Heartbeat(int(beat), phase, int(step), int(gen), pre == "1", int(progress),
                         work, int(busy), int(gap))

    def format(self) -> str:
        return (
            f"{self.beat}|{self.phase}|{self.step}|{self.gen}|{int(self.preempting)}|"
            f"{self.progress}|{self.work}|{self.busy}|{self.gap_ms}"
        )


GAP_WINDOW = 1200
"""Beats over which a worker's longest beat gap is reported (5 minutes at 0.25 s)."""


def beat(
    connect: Callable[[], dist.Store],
    name: str,
    record: Callable[[float], str],
    stop: threading.Event,
    period_s: float,
    quiet: Callable[[], bool] | None = None,
    noticed: Callable[[], bool] | None = None,
    wake: threading.Event | None = None,
) -> None:
    """A worker's heartbeat thread: writes ``record(gap_s)`` to ``hb/<name>`` every
    ``period_s`` (one store write a beat) unless ``quiet()`` (its run commits steps: see the
    module doc), and looks at ``fence/<name>`` every :data:`FENCE_CHECK_S`; a fenced worker
    (evicted while stopped or cut off: its state is no one's now) exits. ``gap_s`` is the
    longest time between two of this thread's beats over the last :data:`GAP_WINDOW`
    beats, beyond the period (a pause of the whole process). Once ``noticed()`` (a
    preemption notice), it sets its ``store_keys.notice`` key and bumps ``store_keys.NOTICES``
    at once, whatever the steps are doing (``wake``, set by the notice's handler, ends the
    beat's wait early). Returns when ``stop`` is set."""
    from collections import deque

    store = connect()
    fence_key, hb_key = store_keys.fence(name), store_keys.heartbeat(name)
    every = max(1, round(FENCE_CHECK_S / period_s))
    beats = 0
    gaps: deque[float] = deque(maxlen=GAP_WINDOW)
    last = time.monotonic()
    told = False
    while True:
        if wake is None:
            if stop.wait(period_s):
                return
        else:
            wake.wait(period_s)
            wake.clear()
            if stop.is_set():
                return
        now = time.monotonic()
        gaps.append(max(0.0, now - last - period_s))
        last = now
        try:
            if not told and noticed is not None and noticed():
                store.set(store_keys.notice(name), str(time.time()))
                store.add(store_keys.NOTICES, 1)
                told = True
            if beats % every == 0 and store.check([fence_key]):
                _log.warning("%s was fenced off by the controller; exiting", name)
                os._exit(0)
            if quiet is None or not quiet():
                store.set(hb_key, record(max(gaps)))
            beats += 1
        except Exception:  # the controller is gone: nothing to report to
            if stop.is_set():
                return
            time.sleep(period_s)
