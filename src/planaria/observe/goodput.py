"""Where a run's wall time went: goodput, badput buckets, replica efficiency, throughput.

Computed from event records alone (docs/events.md). The log is read in append
order; ``t`` is used for durations only, never to reorder records.

Wall time is the first run segment's start → the last one's end
(:mod:`planaria.observe.segments`); the gaps between segments are *downtime*.

Time accounting (:func:`time_breakdown`)
    Every instant of the wall time gets exactly one bucket, so goodput and the
    badput buckets add up to 1. Labelled intervals, highest priority first:

    1. ``checkpoint_stall``: ``[c, c + stall_s]`` per ``checkpoint_saved``,
       where ``c`` is the latest commit of the checkpoint's last step (else the
       latest commit before the record, else ``t - save_s``).
    2. ``restore``: ``[t - restore_s, t]`` per ``restore``.
    3. A committed step's own interval ``[t - duration_s, t]``: if the commit
       stayed committed, its first ``data_wait_s`` is ``data_wait`` and the
       rest is goodput; if it was later rolled back (the same or an earlier
       step committed again later, a ``restore`` to a checkpoint holding fewer
       steps, or a later segment's ``start_step`` at or below it) the whole
       interval is ``wasted_steps``. Checkpoint and restore ``step`` fields count
       the steps a checkpoint holds (the next step to run).
    4. ``waiting_for_replicas``: ``action`` with ``action="pause"`` → the next
       commit (or segment end).
    5. ``recovery``: ``fault_t`` → recovery time of each fault (segment end if
       it never recovered); re-run steps are excluded by rule 3.
    6. ``wasted_steps`` again for failed/skipped steps: from the previous step
       boundary (commit, failure, skip, generation, restore, run start) to the
       ``step_failed``/``step_skipped`` record; the part after ``fault_t`` is
       recovery by rule 5.
    7. ``startup``: segment start → first commit of the segment.
    8. ``downtime``: gaps between segments.

    Whatever no interval covers is ``other`` (e.g. controller overhead between
    steps).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from planaria.observe.segments import Segment, num, step_of

__all__ = ["BUCKETS", "Breakdown", "GoodputTracker", "time_breakdown"]

BUCKETS = (
    "startup",
    "checkpoint_stall",
    "restore",
    "recovery",
    "wasted_steps",
    "waiting_for_replicas",
    "data_wait",
    "downtime",
    "other",
)

# Interval layers, highest priority first: (layer, bucket it counts into).
_LAYERS = (
    ("checkpoint_stall", "checkpoint_stall"),
    ("restore", "restore"),
    ("goodput", "goodput"),
    ("data_wait", "data_wait"),
    ("recomputed", "wasted_steps"),
    ("waiting", "waiting_for_replicas"),
    ("recovery", "recovery"),
    ("failed", "wasted_steps"),
    ("startup", "startup"),
    ("downtime", "downtime"),
)
_RANK = {name: i for i, (name, _) in enumerate(_LAYERS)}
_BOUNDARIES = {"step_committed", "step_failed", "step_skipped", "generation", "restore"}


def _rolled_back(segments: Sequence[Segment]) -> set[int]:
    """``id()`` of the ``step_committed`` records that did not stay committed."""
    kept: list[dict[str, Any]] = []  # a stack, strictly increasing in step
    lost: set[int] = set()

    def pop_while(limit: float) -> None:
        while kept and step_of(kept[-1]) >= limit:
            lost.add(id(kept.pop()))

    for seg in segments:
        start_step = num(seg.run_start.get("start_step")) if seg.run_start else None
        if start_step is not None and seg.index > 0:
            pop_while(start_step)
        for rec in seg.events:
            if rec["event"] == "step_committed":
                pop_while(step_of(rec))
                kept.append(rec)
            elif rec["event"] == "restore" and (back_to := num(rec.get("step"))) is not None:
                # Training went back to the checkpoint's step: what came after is undone.
                pop_while(back_to)
    return lost


@dataclass
class Breakdown:
    """Seconds per bucket; ``goodput_s`` + sum(``badput_s``) == ``wall_s``."""

    wall_s: float = 0.0
    goodput_s: float = 0.0
    badput_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    kept_steps: int = 0
    """Commits that stayed committed."""
    recomputed_steps: int = 0
    """Commits rolled back later (their step ran again, or was lost)."""
    kept_samples: float = 0.0
    """``samples`` summed over the commits that stayed committed."""
    last_step: int | None = None
    """Highest step that stayed committed."""

    @property
    def goodput(self) -> float:
        return self.goodput_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def badput(self) -> dict[str, float]:
        w = self.wall_s
        return {k: (v / w if w > 0 else 0.0) for k, v in self.badput_s.items()}


def _step_intervals(seg: Segment, lost: set[int]) -> list[tuple[float, float, str]]:
    out: list[tuple[float, float, str]] = []
    boundary = seg.start
    for rec in seg.events:
        t = float(rec["t"])
        ev = rec["event"]
        if ev == "step_committed":
            dur = num(rec.get("duration_s"))
            begin = t - dur if dur is not None else boundary
            if id(rec) in lost:
                out.append((begin, t, "recomputed"))
            else:
                wait = min(max(num(rec.get("data_wait_s")) or 0.0, 0.0), t - begin)
                out.append((begin, begin + wait, "data_wait"))
                out.append((begin + wait, t, "goodput"))
        elif ev in ("step_failed", "step_skipped"):
            out.append((boundary, t, "failed"))
        if ev in _BOUNDARIES:
            boundary = t
    return out


def _segment_intervals(
    seg: Segment, lost: set[int], recovery: Sequence[tuple[float, float]]
) -> list[tuple[float, float, str]]:
    out = _step_intervals(seg, lost)
    commit_t: dict[float, float] = {}
    last_commit: float | None = None
    waiting_since: float | None = None
    first_commit: float | None = None
    for rec in seg.events:
        t = float(rec["t"])
        ev = rec["event"]
        if ev == "step_committed":
            commit_t[num(rec.get("step")) or 0.0] = last_commit = t
            first_commit = t if first_commit is None else first_commit
            if waiting_since is not None:
                out.append((waiting_since, t, "waiting"))
                waiting_since = None
        elif ev == "action" and rec.get("action") == "pause" and waiting_since is None:
            waiting_since = t
        elif ev == "checkpoint_saved":
            stall = num(rec.get("stall_s")) or 0.0
            # A checkpoint's step counts the steps it holds: its last commit is step - 1.
            c = commit_t.get((num(rec.get("step")) or 0.0) - 1, last_commit)
            if c is None:
                c = t - (num(rec.get("save_s")) or 0.0)
            out.append((c, c + stall, "checkpoint_stall"))
        elif ev == "restore":
            out.append((t - (num(rec.get("restore_s")) or 0.0), t, "restore"))
    if waiting_since is not None:
        out.append((waiting_since, seg.end, "waiting"))
    out.append((seg.start, first_commit if first_commit is not None else seg.end, "startup"))
    out.extend((a, b, "recovery") for a, b in recovery)
    return [(max(a, seg.start), min(b, seg.end), layer) for a, b, layer in out]


def time_breakdown(
    segments: Sequence[Segment], recovery: Sequence[tuple[float, float]] = ()
) -> Breakdown:
    """Splits the wall time into goodput and badput buckets (module docstring).

    ``recovery`` holds ``(fault_t, recovered_t)`` spans, from
    :func:`planaria.observe.metrics.analyze_faults`; each is clipped to its segment.
    """
    if not segments:
        return Breakdown()
    intervals: list[tuple[float, float, str]] = []
    lost = _rolled_back(segments)
    for seg in segments:
        spans = [(a, b) for a, b in recovery if seg.start <= b and a <= seg.end]
        intervals += _segment_intervals(seg, lost, spans)
    for before, after in itertools.pairwise(segments):
        intervals.append((before.end, after.start, "downtime"))
    lo, hi = segments[0].start, max(s.end for s in segments)
    points: list[tuple[float, int, int]] = []  # (time, layer rank, +1 opens / -1 closes)
    for a, b, layer in intervals:
        a, b = max(a, lo), min(b, hi)
        if b > a:
            points.append((a, _RANK[layer], 1))
            points.append((b, _RANK[layer], -1))
    points.sort()
    out = Breakdown(wall_s=hi - lo, recomputed_steps=len(lost))
    for seg in segments:
        for rec in seg.commits():
            if id(rec) not in lost:
                out.kept_steps += 1
                out.kept_samples += num(rec.get("samples")) or 0.0
                step = int(step_of(rec))
                out.last_step = step if out.last_step is None else max(out.last_step, step)
    seconds = [0.0] * len(_LAYERS)
    active = [0] * len(_LAYERS)
    prev = lo
    for x, rank, delta in points:
        if x > prev:  # the piece [prev, x] belongs to the highest-priority open layer
            for i, n in enumerate(active):
                if n > 0:
                    seconds[i] += x - prev
                    break
            prev = x
        active[rank] += delta
    for (_, bucket), sec in zip(_LAYERS, seconds, strict=True):
        if bucket == "goodput":
            out.goodput_s += sec
        else:
            out.badput_s[bucket] += sec
    covered = sum(seconds)
    out.badput_s["other"] = max(out.wall_s - covered, 0.0)
    return out


class GoodputTracker:
    """Incremental goodput for live displays: kept step time ÷ (now - first run start).

    Kept step time is ``duration_s - data_wait_s`` of each commit; a commit is
    dropped again when the same or an earlier step commits later. It agrees
    with :func:`time_breakdown` up to checkpoint stalls overlapping steps.
    """

    def __init__(self) -> None:
        self.start: float | None = None
        self._kept: list[tuple[float, float]] = []  # (step, kept seconds), increasing step
        self._total = 0.0
        self.ratio = 0.0

    def observe(self, record: dict[str, Any]) -> float:
        t = float(record["t"])
        if self.start is None:
            self.start = t
        if record["event"] == "step_committed":
            step = step_of(record)
            while self._kept and self._kept[-1][0] >= step:
                self._total -= self._kept.pop()[1]
            dur = num(record.get("duration_s")) or 0.0
            kept = max(dur - (num(record.get("data_wait_s")) or 0.0), 0.0)
            self._kept.append((step, kept))
            self._total += kept
        wall = t - self.start
        self.ratio = min(self._total / wall, 1.0) if wall > 0 else 0.0
        return self.ratio
