"""The event listener that feeds experiment trackers: it maps each record
(:func:`~planaria.observe.trackers.base.tracker_entry`) and hands it to every tracker.

A tracker that raises is logged once and disabled: tracking never stops training.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from planaria.observe.trackers.base import Annotation, StepScalars, Tracker, tracker_entry

__all__ = ["TrackerFeed"]

_log = logging.getLogger("planaria.trackers")


class TrackerFeed:
    """``EventLog`` listener (``fit(listeners=[feed])``) writing to ``trackers``; ``close()``
    closes each once (also a disabled one, so it flushes what it has)."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)
        self.disabled: dict[str, str] = {}
        """Trackers that raised, by name: the error (they get nothing more)."""
        self.counts: Counter[str] = Counter()
        self.last_step = 0
        self._closed = False
        self._lock = threading.Lock()

    def __call__(self, record: dict[str, Any]) -> None:
        entry = tracker_entry(record)
        if entry is None:
            return
        with self._lock:  # records come from the controller's and the saver's threads
            if not self._closed:  # a job left open (FinalSaveFailed) logs on after fit
                self._dispatch(record, entry)

    def _dispatch(self, record: dict[str, Any], entry: StepScalars | Annotation) -> None:
        if isinstance(entry, StepScalars):
            if record.get("event") == "step_committed":
                self.last_step = entry.step
            for tracker in self._live():
                self._guard(tracker, tracker.log_scalars, entry)
            return
        self.counts[entry.counter] += 1
        note: Annotation = replace(entry, total=self.counts[entry.counter],
                                   step=self.last_step if entry.step is None else entry.step)
        for tracker in self._live():
            self._guard(tracker, tracker.log_annotation, note)

    def _live(self) -> list[Tracker]:
        return [t for t in self.trackers if t.name not in self.disabled]

    def _guard(self, tracker: Tracker, call: Any, arg: Any) -> None:
        try:
            call(arg)
        except Exception as err:  # a tracker must never break training
            self.disabled[tracker.name] = f"{type(err).__name__}: {err}"
            _log.exception("tracker %s failed and is disabled for the rest of the run",
                           tracker.name)

    def close(self) -> None:
        """Closes every tracker (idempotent); a close that raises is logged."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception:
                _log.exception("tracker %s failed to close", tracker.name)
