"""Simulator figures measured from a real run's event log (docs/events.md).

Every other figure is a median over the run's records, from :mod:`planaria.observe.metrics`
where it defines one (``detect_s``, ``replacement_s``, ``restore_s``):

- ``step_s``: the mean ``duration_s - data_wait_s`` of the commits at full width
  (a mean: the total is what counts); other widths go to ``step_s_by_width``.
  ``step_overhead_s``: the commit-to-commit gap minus the step, plus the mean
  data wait.
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

import bisect
import itertools
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planaria.faults.errors import ConfigError
from planaria.observe.events import read_events
from planaria.observe.metrics import RunSummary, summarize
from planaria.observe.segments import num, select_run, split_segments
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
    waits: list[float] = []
    for c in commits:
        width, dur = int(num(c.get("width")) or 0), num(c.get("duration_s"))
        wait = min(max(num(c.get("data_wait_s")) or 0.0, 0.0), dur or 0.0)
        waits.append(wait)
        if width and dur is not None:
            by_width.setdefault(width, []).append(dur - wait)
    for a, b in itertools.pairwise(commits):
        same = a.get("gen") == b.get("gen") and num(b.get("step")) == (num(a.get("step")) or 0) + 1
        if same and (dur := num(b.get("duration_s"))) is not None:
            gaps.append(float(b["t"]) - float(a["t"]) - dur)
    medians = {w: statistics.fmean(v) for w, v in by_width.items()}
    # Waiting for data is no step time in the event log's goodput: it joins the overhead.
    overhead = max(_median(gaps) or 0.0, 0.0) + statistics.fmean(waits)
    return {"full": medians.get(full), "by_width": medians, "overhead": overhead}


def _recovering_step_s(commits: list[dict[str, Any]], recovered_t: float | None) -> float:
    """The duration of the commit that ended a recovery: the latest at or before the
    ``recovered`` record (written just after it, so their times differ)."""
    times = [float(c["t"]) for c in commits]
    i = bisect.bisect_right(times, recovered_t if recovered_t is not None else -math.inf)
    return (num(commits[i - 1].get("duration_s")) or 0.0) if i else 0.0


def _joins(events: list[dict[str, Any]], commits: list[dict[str, Any]], overhead: float
           ) -> list[float]:
    at = {(c.get("gen"), c.get("step")): i for i, c in enumerate(commits)}
    out: list[float] = []
    for rec in events:
        i = at.get((rec.get("gen"), rec.get("step"))) if rec["event"] == "joined" else None
        if i and (dur := num(commits[i].get("duration_s"))) is not None:
            gap = float(commits[i]["t"]) - float(commits[i - 1]["t"]) - dur - overhead
            out.append(max(gap, 0.0))
    return out


def calibrate(run_dir: str | Path) -> Calibration:
    """Reads ``run_dir``'s event log into simulator figures (module docstring)."""
    events = select_run(read_events(run_dir).events)  # the latest run, as summarize reads
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
    rebuild = [f.recover_s - (f.detect_s or 0.0) - _recovering_step_s(commits, f.recovered_t)
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
        "join_stall_s": _median(_joins(events, commits, steps["overhead"])),
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
    # Replaying the run, a cost it never paid is zero; a replacement that never came
    # keeps the default (it arrives after the run's end).
    measured: dict[str, Any] = {k: (0.0 if v is None else v) for k, v in figures.items()
                                if k != "step_s" and not (k == "replacement_s" and v is None)}
    params = SimParams(
        nodes=full,
        gpus_per_node=1,
        node_mtbf_h=1e9,  # the trace replaces drawn failures
        step_s=step_s,
        step_s_by_width=tuple((w, s) for w, s in sorted(steps["by_width"].items()) if w != full),
        steps=int(num(run_start.get("steps")) or len(commits)),
        trace=_trace(events, segments[0].start, full),
        **measured,
    )
    return Calibration(params=params, strategy=strategy, summary=summary, figures=figures,
                       interval_s=every * step_s if every else None)


def _trace(events: list[dict[str, Any]], start: float, replicas: int) -> FailureTrace:
    """By step when every fault names its step in flight (the run's speed drifts with
    its machine's load, its steps do not), else by time."""
    slot = {f"w{i}": i for i in range(replicas)}
    at_step: list[float | None] = []
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
                    at_step.append(num(rec.get("step")))
                    slots.append(slot[worker.strip()])
                    planned.append(rec.get("kind") == "preempted")
    if at_step and all(s is not None for s in at_step):
        return FailureTrace(times=tuple(s or 0.0 for s in at_step), replicas=tuple(slots),
                            planned=tuple(planned), unit="step")
    return FailureTrace(times=tuple(times), replicas=tuple(slots), planned=tuple(planned))
