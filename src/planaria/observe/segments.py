"""Run segments and per-commit series of an event log (docs/events.md).

Each ``run_start`` opens a segment (a resumed run appends a new one to the same
log). A segment ends at its ``run_end`` or, if the controller crashed, at the
latest ``t`` among its records. Records before the first ``run_start`` (a log
whose head was damaged) form an implicit segment that starts at its first
record. The log is read in append order; ``t`` gives durations, never order.

A run dir can hold several *runs* (jobs) in its one append-only log: a run is a
``run_start`` that does not continue the job before it, with the segments that resume
it after (:func:`split_runs`). Whether a ``run_start`` continues is its ``resume`` field
(true: it resumes the run dir's checkpoints); a log written before that field existed
tells by the segment's ``checkpoint_lineage`` record (``mode`` other than ``resume``:
a new run), and counts a segment without either as a continuation, as it always did.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Segment",
    "UnknownRun",
    "num",
    "replica_efficiency",
    "run_ids",
    "select_run",
    "split_runs",
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


def _continues(segment: Segment) -> bool:
    """Whether a segment resumes the run before it (see the module docstring)."""
    start = segment.run_start
    if start is None:
        return True
    if "resume" in start:
        return bool(start["resume"])
    lineage = next((e for e in segment.events if e["event"] == "checkpoint_lineage"), None)
    return lineage is None or lineage.get("mode", "resume") == "resume"


def split_runs(events: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The log's records cut into runs (jobs), oldest first: a ``run_start`` that does not
    continue the job before it opens a run (see the module docstring)."""
    runs: list[list[dict[str, Any]]] = []
    for seg in split_segments(events):
        if not runs or not _continues(seg):
            runs.append([])
        runs[-1].extend(seg.events)
    return runs


def run_ids(run: Sequence[dict[str, Any]]) -> list[str]:
    """The ids of a run's segments (its ``run_start`` records), oldest first: the first is
    the run's id."""
    return [str(e["run_id"]) for e in run if e["event"] == "run_start" and e.get("run_id")]


class UnknownRun(LookupError):
    """No run in the log has the id asked for (the message lists those it has)."""


def select_run(events: Iterable[dict[str, Any]], run_id: str | None = None
               ) -> list[dict[str, Any]]:
    """The records of one run of the log: the latest, or the one ``run_id`` names (the id
    of any of its segments, or a prefix of one that fits one run only); :class:`UnknownRun`
    if none or several do. An empty log gives an empty list."""
    runs = split_runs(events)
    if run_id is None:
        return runs[-1] if runs else []
    found = [r for r in runs if run_id in run_ids(r)] or [
        r for r in runs if any(i.startswith(run_id) for i in run_ids(r))]
    if len(found) != 1:
        known = ", ".join(ids[0] for r in runs if (ids := run_ids(r))) or "none"
        how = "no run" if not found else f"{len(found)} runs"
        raise UnknownRun(f"{how} in this log with the id {run_id!r} (its runs: {known})")
    return found[0]


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
