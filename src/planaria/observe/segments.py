"""Run segments and per-commit series of an event log (docs/events.md).

Each ``run_start`` opens a segment (a resumed run appends a new one to the same
log). A segment ends at its ``run_end`` or, if the controller crashed, at the
latest ``t`` among its records. Records before the first ``run_start`` (a log
whose head was damaged) form an implicit segment that starts at its first
record. The log is read in append order; ``t`` gives durations, never order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Segment",
    "num",
    "replica_efficiency",
    "split_segments",
    "step_of",
    "throughput_series",
    "width_series",
]


def num(value: Any) -> float | None:
    """A finite float from a record field, or None (missing, null, "nan", garbage)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def step_of(record: dict[str, Any]) -> float:
    """A record's ``step`` as a float (0 when missing)."""
    return num(record.get("step")) or 0.0


@dataclass
class Segment:
    """One controller lifetime in the log: a ``run_start`` and what followed it."""

    index: int
    start: float
    end: float
    events: list[dict[str, Any]] = field(default_factory=list)
    run_start: dict[str, Any] | None = None
    run_end: dict[str, Any] | None = None

    @property
    def target(self) -> int | None:
        """``run_start.replicas``, else the widest commit seen, else None."""
        replicas = num(self.run_start.get("replicas")) if self.run_start else None
        if replicas:
            return int(replicas)
        widths = [num(e.get("width")) or 0 for e in self.events if e["event"] == "step_committed"]
        return int(max(widths)) if widths and max(widths) > 0 else None

    def commits(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "step_committed"]


def split_segments(events: Iterable[dict[str, Any]]) -> list[Segment]:
    """Splits a log into run segments (see the module docstring)."""
    segments: list[Segment] = []
    for record in events:
        t = float(record["t"])
        if record["event"] == "run_start" or not segments:
            start_rec = record if record["event"] == "run_start" else None
            segments.append(Segment(len(segments), t, t, run_start=start_rec))
        seg = segments[-1]
        seg.events.append(record)
        seg.end = max(seg.end, t)
        if record["event"] == "run_end":
            seg.run_end = record
    return segments


def replica_efficiency(segments: Sequence[Segment]) -> float | None:
    """∫ live width dt ÷ ∫ target dt over the wall time; None without a target or wall.

    Live width is ``step_committed.width``, held backwards: a commit's width
    covers the time since the previous commit of its segment (the first commit
    covers its own ``duration_s``). Startup, the tail after the last commit and
    downtime count as width 0. The target is ``run_start.replicas`` of each
    segment; downtime is weighed with the next segment's target.
    """
    live = want = 0.0
    for i, seg in enumerate(segments):
        target = seg.target
        if target is None:
            return None
        want += target * (seg.end - seg.start)
        if i > 0:
            want += target * max(seg.start - segments[i - 1].end, 0.0)
        prev: float | None = None
        for rec in seg.commits():
            t = float(rec["t"])
            width = num(rec.get("width")) or 0.0
            begin = prev if prev is not None else t - (num(rec.get("duration_s")) or 0.0)
            live += width * max(t - max(begin, seg.start), 0.0)
            prev = t
    return live / want if want > 0 else None


def throughput_series(events: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
    """``(t, samples/s)`` per commit: ``samples_per_s``, else ``samples / duration_s``."""
    out = []
    for rec in events:
        if rec["event"] != "step_committed":
            continue
        sps = num(rec.get("samples_per_s"))
        if sps is None:
            samples, dur = num(rec.get("samples")), num(rec.get("duration_s"))
            sps = samples / dur if samples is not None and dur else None
        if sps is not None:
            out.append((float(rec["t"]), sps))
    return out


def width_series(events: Iterable[dict[str, Any]]) -> list[tuple[float, int]]:
    """``(t, live replicas)`` from ``generation.world_size`` and ``step_committed.width``."""
    out = []
    for rec in events:
        key = {"generation": "world_size", "step_committed": "width"}.get(rec["event"])
        value = num(rec.get(key)) if key else None
        if value is not None:
            out.append((float(rec["t"]), int(value)))
        elif rec["event"] == "run_end":
            out.append((float(rec["t"]), 0))
    return out
