"""The run's event log: JSON lines in ``RUN_DIR/events.jsonl``.

Every record carries ``t`` (Unix time) and ``event`` (a name from docs/events.md).
The writer appends one line per record (one write each) so that a crash loses at
most the line being written; the reader tolerates a torn or garbled tail. A run
directory that cannot take a record (a full disk) does not stop the job: the
record is held in memory and written, in order, once the disk has room; past the
hold it is dropped and counted (:attr:`EventLog.dropped`), a warning is logged,
and once records are written again a ``records_dropped`` record notes the gap
(see :mod:`planaria.observe.append_file`).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planaria.observe.append_file import AppendFile

__all__ = ["EVENTS_FILE", "EventLog", "ReadResult", "read_events"]

EVENTS_FILE = "events.jsonl"

_log = logging.getLogger("planaria.observe.events")


def _jsonable(value: Any) -> Any:
    """Turns floats that JSON cannot carry (nan, inf) into strings, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _line(record: dict[str, Any]) -> str:
    return json.dumps(_jsonable(record), separators=(",", ":"), default=str)


class EventLog:
    """Appends events to ``run_dir/events.jsonl``; thread-safe."""

    def __init__(self, run_dir: str | Path, *, clock: Any = time.time) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._file = AppendFile(self.path, what="the event log", on_gap=self._note_gap)
        self._lock = threading.Lock()
        self._listeners: list[Any] = []

    @property
    def dropped(self) -> int:
        """Records that could not be written (a full disk), over the log's life."""
        return self._file.dropped

    def _note_gap(self, dropped: int, since_t: float) -> None:
        """Written after the first record that reached the file again after failures."""
        self._file.write_line(_line({"t": self._clock(), "event": "records_dropped",
                                     "file": EVENTS_FILE, "dropped": dropped,
                                     "since_t": since_t, "total": self._file.dropped}))

    def add_listener(self, listener: Any) -> None:
        """Calls ``listener(record)`` after each record is written (progress, Prometheus)."""
        self._listeners.append(listener)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {"t": fields.pop("t", None) or self._clock(), "event": event}
        record.update(fields)
        line = _line(record)
        with self._lock:
            self._file.write_line(line)  # a record the disk cannot take is dropped, counted
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:  # a display must never stop training
                _log.exception("event listener failed on %s", event)
        return record

    def close(self) -> None:
        with self._lock:
            self._file.close()


@dataclass
class ReadResult:
    """Events read from a log, with warnings about damaged lines."""

    events: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.events)


def read_events(path: str | Path) -> ReadResult:
    """Reads an event log (a run dir or the file itself).

    A garbled or torn line (a crash mid-write) is skipped with a warning that
    names it; the records around it are kept, so a resumed run's log still reads.
    """
    p = Path(path)
    if p.is_dir():
        p = p / EVENTS_FILE
    if not p.exists():
        raise FileNotFoundError(
            f"no event log at {p}: pass a run directory written by `planaria run` or fit()"
        )
    result = ReadResult()
    with p.open("r", encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            stripped = line.strip()
            if not stripped:
                continue
            try:
                record = json.loads(stripped)
                if not isinstance(record, dict) or "event" not in record or "t" not in record:
                    raise ValueError("not an event record")
                float(record["t"])
            except (ValueError, TypeError) as err:
                result.warnings.append(f"{p}:{number}: damaged line ({err}); skipped")
                continue
            result.events.append(record)
    return result
