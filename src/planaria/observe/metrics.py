"""Recovery metrics of a run, from its event log alone (names as in DESIGN.md).

Per fault (``fault`` record, keyed by ``fault_id`` within its run segment):

- ``detect_s``: ``detected.detect_s``, else ``fault.t - fault.fault_t``. If the
  ``fault`` line was lost to damage, its ``detected`` record opens the fault
  (``fault_t = t - detect_s``, ``step`` None).
- ``recover_s``: the fault's own ``recovered.recover_s`` (else its ``t - fault_t``).
  A fault that has no ``recovered`` record of its own (a second fault during a
  recovery, closed by the recovered record of the other one) recovers at the
  first ``step_committed`` after its ``fault`` record: ``commit.t - fault_t``.
  A fault with neither before its segment ends (the run stopped mid-recovery,
  or crashed) is *unrecovered*: ``recover_s`` and ``lost_steps`` are None.
- ``lost_steps``: ``recovered.lost_steps``, else the attributed ``restore``'s
  ``lost_steps``, else (highest step committed before the fault) - (step of the
  recovering commit) + 1, at least 0.
- ``replacement``/``replacement_s``: the worker(s) requested with ``replaces``
  naming one of the fault's workers (``worker`` may list several, comma-
  separated; the latest such fault gets it), and their ``replacement_ready``
  time; with several replacements, the slowest (the fault is healed when the
  last one is ready), and ``replacement`` lists them comma-separated.
- ``join_s``: those replacements' ``joined.join_s`` (the slowest).
- ``restore_s``: the first ``restore`` after an ``action="restore"`` naming the
  fault, before the fault recovered.

Statistics (``Stats``): count, total, mean, p50, p90, max; percentiles
interpolate linearly between closest ranks (numpy's default); all None when
there are no values. Time accounting (goodput, badput, replica efficiency) is
defined in :mod:`planaria.observe.goodput` and :mod:`planaria.observe.segments`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from planaria.observe.events import read_events
from planaria.observe.goodput import time_breakdown
from planaria.observe.rank_times import RankSummary, summarize_ranks
from planaria.observe.segments import (
    Segment,
    num,
    replica_efficiency,
    select_run,
    split_segments,
    throughput_series,
)

__all__ = ["FaultMetrics", "RunSummary", "Stats", "analyze_faults", "percentile", "summarize"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0 ≤ q ≤ 1), linear between closest ranks; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Stats:
    """Summary statistics of a list of durations in seconds."""

    count: int = 0
    total: float = 0.0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Stats:
        vals = [v for v in values if v is not None]
        if not vals:
            return cls()
        total = sum(vals)
        return cls(len(vals), total, total / len(vals), percentile(vals, 0.5),
                   percentile(vals, 0.9), max(vals))


@dataclass
class FaultMetrics:
    """What one fault cost; None where a figure does not apply or never happened."""

    fault_id: Any
    segment: int
    kind: str | None
    worker: str | None
    step: int | None
    fault_t: float
    detected_t: float
    detect_s: float | None = None
    recover_s: float | None = None
    recovered_t: float | None = None
    lost_steps: int | None = None
    action: str | None = None
    replacement: str | None = None
    replacement_s: float | None = None
    join_s: float | None = None
    restore_s: float | None = None
    message: str | None = None
    _first_commit: tuple[float, float] | None = field(default=None, repr=False)
    _high_step: float | None = field(default=None, repr=False)
    _restore_lost: int | None = field(default=None, repr=False)
    _replaced: set[str] = field(default_factory=set, repr=False)

    @property
    def workers(self) -> list[str]:
        """The failed workers: ``worker`` may name several, comma-separated."""
        return [w.strip() for w in (self.worker or "").split(",") if w.strip()]

    @property
    def recovered(self) -> bool:
        return self.recovered_t is not None

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        out["recovered"] = self.recovered
        return out


def _int(value: Any) -> int | None:
    v = num(value)
    return int(v) if v is not None else None


def _latest(current: float | None, value: float | None) -> float | None:
    return value if current is None else current if value is None else max(current, value)


def _analyze_segment(seg: Segment, high: float | None) -> tuple[list[FaultMetrics], float | None]:
    faults: list[FaultMetrics] = []
    by_id: dict[Any, FaultMetrics] = {}
    by_new_worker: dict[str, FaultMetrics] = {}
    requested_t: dict[str, float] = {}
    restoring: FaultMetrics | None = None
    for rec in seg.events:
        ev, t = rec["event"], float(rec["t"])
        fm = by_id.get(rec.get("fault_id"))
        if ev == "fault" or (ev == "detected" and fm is None):
            # a ``detected`` record stands in for a ``fault`` line lost to damage
            fault_t = num(rec.get("fault_t"))
            if ev == "detected" and num(rec.get("detect_s")) is not None:
                fault_t = t - (num(rec.get("detect_s")) or 0.0)
            fm = FaultMetrics(
                fault_id=rec.get("fault_id", f"#{len(faults)}"), segment=seg.index,
                kind=rec.get("kind"), worker=rec.get("worker"), step=_int(rec.get("step")),
                fault_t=fault_t if fault_t is not None else t, detected_t=t,
                detect_s=t - fault_t if fault_t is not None else None,
                message=rec.get("message"), _high_step=high,
            )
            faults.append(fm)
            by_id[fm.fault_id] = fm
        elif ev == "detected" and fm is not None:
            fm.detect_s = num(rec.get("detect_s")) if "detect_s" in rec else fm.detect_s
        elif ev == "action" and fm is not None:
            fm.action = fm.action or rec.get("action")
            if rec.get("action") == "restore":
                restoring = fm
        elif ev == "restore" and restoring is not None and not restoring.recovered:
            if restoring.restore_s is None:
                restoring.restore_s = num(rec.get("restore_s"))
                restoring._restore_lost = _int(rec.get("lost_steps"))
        elif ev == "recovered" and fm is not None and not fm.recovered:
            fm.recovered_t = t
            rs = num(rec.get("recover_s"))
            fm.recover_s = rs if rs is not None else t - fm.fault_t
            fm.lost_steps = _int(rec.get("lost_steps"))
        elif ev == "step_committed":
            step = num(rec.get("step")) or 0.0
            for f in faults:
                if f._first_commit is None:
                    f._first_commit = (t, step)
            high = step if high is None else max(high, step)
        elif ev == "replacement_requested":
            old, new = str(rec.get("replaces")), rec.get("worker")
            cands = [f for f in faults if old in f.workers and old not in f._replaced]
            if cands and new is not None:
                f = cands[-1]
                f._replaced.add(old)
                f.replacement = new if f.replacement is None else f"{f.replacement},{new}"
                by_new_worker[new] = f
                requested_t[new] = t
        elif ev == "replacement_ready" and rec.get("worker") in by_new_worker:
            new = rec["worker"]
            rs = num(rec.get("replacement_s"))
            f = by_new_worker[new]
            rs = rs if rs is not None else t - requested_t[new]
            f.replacement_s = _latest(f.replacement_s, rs)
        elif ev == "joined" and rec.get("worker") in by_new_worker:
            f = by_new_worker[rec["worker"]]
            f.join_s = _latest(f.join_s, num(rec.get("join_s")))
    for f in faults:
        if not f.recovered and f._first_commit is not None:
            f.recovered_t, step = f._first_commit
            f.recover_s = f.recovered_t - f.fault_t
            if f._restore_lost is not None:
                f.lost_steps = f._restore_lost
            else:
                f.lost_steps = int(max((f._high_step or -1.0) - step + 1, 0))
        elif f.recovered and f.lost_steps is None:
            f.lost_steps = f._restore_lost if f._restore_lost is not None else 0
    return faults, high


def analyze_faults(segments: Sequence[Segment]) -> list[FaultMetrics]:
    """Per-fault metrics, in log order (semantics in the module docstring)."""
    out: list[FaultMetrics] = []
    high: float | None = None
    for seg in segments:
        faults, high = _analyze_segment(seg, high)
        out += faults
    return out


@dataclass
class RunSummary:
    """Everything ``planaria report`` shows; ``to_json()`` is its stable form."""

    run_id: str | None = None
    status: str = "empty"
    segments: int = 0
    start_t: float | None = None
    wall_s: float = 0.0
    goodput: float = 0.0
    goodput_s: float = 0.0
    badput: dict[str, float] = field(default_factory=dict)
    badput_s: dict[str, float] = field(default_factory=dict)
    replica_efficiency: float | None = None
    target_replicas: int | None = None
    samples: float = 0.0
    samples_per_s: float | None = None
    steps: dict[str, Any] = field(default_factory=dict)
    faults: list[FaultMetrics] = field(default_factory=list)
    recover_s: Stats = field(default_factory=Stats)
    detect_s: Stats = field(default_factory=Stats)
    checkpoints: dict[str, Any] = field(default_factory=dict)
    throughput: list[tuple[float, float]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    """The evaluations (``eval`` records: step, metrics, samples, seconds), one per step
    (the last recorded), in step order."""
    ranks: RankSummary | None = None
    """Where each rank's step time went (:mod:`planaria.observe.rank_times`); None when the
    log's steps do not say."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (no series; see ``throughput`` for the samples/s series)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("faults", "throughput")}
        out["faults"] = [f.to_json() for f in self.faults]
        unrecovered = sum(not f.recovered for f in self.faults)
        kinds: dict[str, int] = {}
        for f in self.faults:
            kinds[str(f.kind)] = kinds.get(str(f.kind), 0) + 1
        lost = sum(f.lost_steps or 0 for f in self.faults)
        out["fault_totals"] = {"faults": len(self.faults), "unrecovered": unrecovered,
                               "by_kind": kinds, "lost_steps": lost}
        return out


def _steps(segments: Sequence[Segment], events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    counts = {e: 0 for e in ("step_committed", "step_failed", "step_skipped")}
    for rec in events:
        if rec["event"] in counts:
            counts[rec["event"]] += 1
    target = num(segments[-1].run_start.get("steps")) if segments[-1].run_start else None
    return {"commits": counts["step_committed"], "failed": counts["step_failed"],
            "skipped": counts["step_skipped"], "target": int(target) if target else None}


def _checkpoints(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    restores = [e for e in events if e["event"] == "restore"]
    return {
        "saved": len(saved),
        "failed": sum(e["event"] == "checkpoint_failed" for e in events),
        "last_step": _int(saved[-1].get("step")) if saved else None,
        "bytes": sum(num(e.get("bytes")) or 0 for e in saved),
        "stall_s": asdict(Stats.of(num(e.get("stall_s")) for e in saved)),
        "save_s": asdict(Stats.of(num(e.get("save_s")) for e in saved)),
        "restores": len(restores),
        "restore_s": asdict(Stats.of(num(e.get("restore_s")) for e in restores)),
    }


def _evals(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    by_step = {rec.get("step"): {k: rec.get(k) for k in ("step", "metrics", "samples", "seconds")}
               for rec in events if rec["event"] == "eval"}
    return [by_step[s] for s in sorted(by_step, key=lambda s: num(s) or 0)]


def summarize(source: str | Path | Iterable[dict[str, Any]],
              run: str | None = None) -> RunSummary:
    """The summary of one run of a run directory, an ``events.jsonl`` path, or records: the
    latest run, or the one ``run`` names (:func:`~planaria.observe.segments.select_run`:
    a log holds several runs when a run dir was used again without resuming; a resumed
    job stays one run of several segments). :class:`~planaria.observe.segments.UnknownRun`
    if ``run`` names none.

    Damaged lines are skipped by :func:`planaria.observe.events.read_events`; their
    warnings are kept in ``RunSummary.warnings``.
    """
    warnings: list[str] = []
    if isinstance(source, (str, Path)):
        read = read_events(source)
        events, warnings = read.events, list(read.warnings)
    else:
        events = list(source)
    events = select_run(events, run)
    segments = split_segments(events)
    if not segments:
        return RunSummary(warnings=warnings)
    if segments[0].run_start is None:
        warnings.append("the log does not begin with run_start; its head may be missing")
    faults = analyze_faults(segments)
    seg_end = {s.index: s.end for s in segments}
    spans = [(f.fault_t, f.recovered_t or seg_end[f.segment]) for f in faults]
    breakdown = time_breakdown(segments, spans)
    steps = _steps(segments, events)
    steps.update(committed=breakdown.kept_steps, recomputed=breakdown.recomputed_steps,
                 last=breakdown.last_step)
    samples = breakdown.kept_samples
    first, last = segments[0].run_start, segments[-1].run_end
    return RunSummary(
        run_id=(first or {}).get("run_id"),
        status=str(last.get("status")) if last else "incomplete",
        segments=len(segments),
        start_t=segments[0].start,
        wall_s=breakdown.wall_s,
        goodput=breakdown.goodput,
        goodput_s=breakdown.goodput_s,
        badput=breakdown.badput,
        badput_s=dict(breakdown.badput_s),
        replica_efficiency=replica_efficiency(segments),
        target_replicas=segments[-1].target,
        samples=samples,
        samples_per_s=samples / breakdown.wall_s if breakdown.wall_s > 0 else None,
        steps=steps,
        faults=faults,
        recover_s=Stats.of(f.recover_s for f in faults),
        detect_s=Stats.of(f.detect_s for f in faults),
        checkpoints=_checkpoints(events),
        throughput=throughput_series(events),
        warnings=warnings,
        evals=_evals(events),
        ranks=summarize_ranks(events),
    )
