"""Simulator figures measured from a real run's event log (docs/events.md).

Every figure is a median over the run's records, from :mod:`planaria.metrics`
where it defines one (``detect_s``, ``replacement_s``, ``restore_s``):

- ``step_s``: the mean ``step_committed.duration_s`` at full width (a mean: the
  total is what counts); other widths go to
  ``step_s_by_width``. ``step_overhead_s``: commit-to-commit gap minus the step.
- ``rebuild_s``: ``recover_s - detect_s`` minus the recovering step itself.
- ``join_stall_s``: the gap before the first commit that includes a
  replacement, beyond its step and the usual overhead.
- ``ckpt_stall_s``/``ckpt_write_s``: ``checkpoint_saved.stall_s`` and
  ``save_s - stall_s``. ``startup_s``: run start → the first step's start;
  ``shutdown_s``: the last commit → the run's end.

The run's own failures become a :class:`FailureTrace` (times from the run's
start; a replacement keeps the replica slot of the worker it replaces), so the
simulator can replay the run itself.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planaria.errors import ConfigError
from planaria.events import read_events
from planaria.metrics import RunSummary, summarize
from planaria.segments import num, split_segments
from planaria.sim.params import FailureTrace, SimParams, Strategy

__all__ = ["Calibration", "calibrate"]


@dataclass(kw_only=True)
class Calibration:
    """The measured figures, the run's own failures, and what it measured itself."""

    params: SimParams
    """Replays the run: ``trace`` set, ``steps`` = the run's steps."""
    strategy: Strategy
    interval_s: float | None
    summary: RunSummary
    figures: dict[str, float | None]

    @property
    def measured_goodput(self) -> float:
        return self.summary.goodput


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _commit_figures(commits: list[dict[str, Any]], full: int) -> dict[str, Any]:
    by_width: dict[int, list[float]] = {}
    gaps: list[float] = []
    for c in commits:
        width, dur = int(num(c.get("width")) or 0), num(c.get("duration_s"))
        if width and dur is not None:
            by_width.setdefault(width, []).append(dur)
    for a, b in itertools.pairwise(commits):
        same = a.get("gen") == b.get("gen") and num(b.get("step")) == (num(a.get("step")) or 0) + 1
        if same and (dur := num(b.get("duration_s"))) is not None:
            gaps.append(float(b["t"]) - float(a["t"]) - dur)
    medians = {w: statistics.fmean(v) for w, v in by_width.items()}
    return {"full": medians.get(full), "by_width": medians,
            "overhead": max(_median(gaps) or 0.0, 0.0)}


def _joins(events: list[dict[str, Any]], overhead: float) -> list[float]:
    out: list[float] = []
    prev: dict[str, Any] | None = None
    commits_by_t: dict[float, dict[str, Any]] = {}
    for rec in events:
        if rec["event"] == "step_committed":
            commits_by_t[float(rec["t"])] = rec
    for rec in events:
        if rec["event"] == "step_committed":
            prev = rec
        elif rec["event"] == "joined" and prev is not None:
            nxt = [c for t, c in commits_by_t.items() if t >= float(prev["t"]) and c is not prev
                   and c.get("step") == rec.get("step")]
            if nxt and (dur := num(nxt[0].get("duration_s"))) is not None:
                out.append(max(float(nxt[0]["t"]) - float(prev["t"]) - dur - overhead, 0.0))
    return out


def _prior(events: list[dict[str, Any]], t: float) -> dict[str, Any] | None:
    """The last commit before ``t``, to start from the join's own window."""
    last = None
    for rec in events:
        if rec["event"] == "step_committed" and float(rec["t"]) < t:
            last = rec
    return last


def calibrate(run_dir: str | Path) -> Calibration:
    """Reads ``run_dir``'s event log into simulator figures (module docstring)."""
    events = read_events(run_dir).events
    segments = split_segments(events)
    if not segments or not any(s.commits() for s in segments):
        raise ConfigError(f"run_dir={str(run_dir)!r} is not valid: its event log has no "
                          "committed step to measure; pass a run that trained")
    summary = summarize(events)
    full = segments[0].target or 1
    commits = [c for s in segments for c in s.commits()]
    steps = _commit_figures(commits, full)
    step_s = steps["full"] or statistics.median(steps["by_width"].values())
    faults = summary.faults
    dur_at = {float(c["t"]): num(c.get("duration_s")) or 0.0 for c in commits}
    rebuild = [f.recover_s - (f.detect_s or 0.0) - dur_at.get(f.recovered_t or -1.0, 0.0)
               for f in faults if f.recover_s is not None and f.action in ("resize", "pause")]
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    stall = [num(e.get("stall_s")) or 0.0 for e in saved]
    write = [max((num(e.get("save_s")) or 0.0) - (num(e.get("stall_s")) or 0.0), 0.0)
             for e in saved]
    first = commits[0]
    figures: dict[str, float | None] = {
        "step_s": step_s,
        "step_overhead_s": steps["overhead"],
        "detect_s": _median([f.detect_s for f in faults if f.detect_s is not None]),
        "rebuild_s": _median([max(r, 0.0) for r in rebuild]),
        "replacement_s": _median([f.replacement_s for f in faults if f.replacement_s]),
        "join_stall_s": _median(_joins(events, steps["overhead"])),
        "restore_s": _median([num(e.get("restore_s")) or 0.0 for e in events
                              if e["event"] == "restore"]),
        "ckpt_stall_s": _median(stall),
        "ckpt_write_s": _median(write),
        "startup_s": float(first["t"]) - (num(first.get("duration_s")) or 0.0) - segments[0].start,
        "shutdown_s": max(segments[-1].end - float(commits[-1]["t"]), 0.0),
    }
    run_start = segments[0].run_start or {}
    config = run_start.get("config") or {}
    strategy = config.get("on_worker_lost", "resize")
    if strategy not in ("restore", "pause", "resize"):
        strategy = "resize"
    chosen = [e for e in events if e["event"] == "checkpoint_interval"]
    every = num(chosen[-1].get("every_steps")) if chosen else None
    params = SimParams(
        nodes=full,
        gpus_per_node=1,
        node_mtbf_h=1e9,  # the trace replaces drawn failures
        step_s=step_s,
        step_s_by_width=tuple((w, s) for w, s in sorted(steps["by_width"].items()) if w != full),
        steps=int(num(run_start.get("steps")) or len(commits)),
        trace=_trace(events, segments[0].start, full),
        **{k: v for k, v in figures.items() if k != "step_s" and v is not None},
    )
    return Calibration(params=params, strategy=strategy, summary=summary, figures=figures,
                       interval_s=every * step_s if every else None)


def _trace(events: list[dict[str, Any]], start: float, replicas: int) -> FailureTrace:
    slot = {f"w{i}": i for i in range(replicas)}
    times: list[float] = []
    slots: list[int] = []
    planned: list[bool] = []
    for rec in events:
        if rec["event"] == "replacement_requested" and str(rec.get("replaces")) in slot:
            slot[str(rec.get("worker"))] = slot[str(rec.get("replaces"))]
        elif rec["event"] == "fault":
            fault_t = num(rec.get("fault_t")) or float(rec["t"])
            for worker in str(rec.get("worker") or "").split(","):
                if worker.strip() in slot:
                    times.append(max(fault_t - start, 0.0))
                    slots.append(slot[worker.strip()])
                    planned.append(rec.get("kind") == "preempted")
    return FailureTrace(times=tuple(times), replicas=tuple(slots), planned=tuple(planned))
