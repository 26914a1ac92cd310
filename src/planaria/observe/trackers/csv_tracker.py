"""CSV tracker: ``steps.csv`` (one row a step or evaluation: step, time, then the scalars'
columns) and ``events.csv`` (one row a recovery or checkpoint event)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from planaria.observe.trackers.base import Annotation, StepScalars

__all__ = ["CsvTracker"]


class CsvTracker:
    """Writes ``log_dir/steps.csv`` and ``log_dir/events.csv``, flushed after each row.

    ``steps.csv`` is long-form (``step,t,name,value``) so that a metric seen late (an
    evaluation) needs no new column; ``events.csv`` is ``step,t,event,total,text``."""

    name = "csv"

    def __init__(self, log_dir: str | Path) -> None:
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._steps: Any = (self.dir / "steps.csv").open("w", newline="", encoding="utf-8")
        self._events: Any = (self.dir / "events.csv").open("w", newline="", encoding="utf-8")
        self._step_rows = csv.writer(self._steps)
        self._event_rows = csv.writer(self._events)
        self._step_rows.writerow(["step", "t", "name", "value"])
        self._event_rows.writerow(["step", "t", "event", "total", "text"])

    def log_scalars(self, entry: StepScalars) -> None:
        self._step_rows.writerows([entry.step, entry.t, k, repr(v)]
                                  for k, v in entry.values.items())
        self._steps.flush()

    def log_annotation(self, note: Annotation) -> None:
        self._event_rows.writerow([note.step, note.t, note.kind, note.total, note.text])
        self._events.flush()

    def close(self) -> None:
        self._steps.close()
        self._events.close()
