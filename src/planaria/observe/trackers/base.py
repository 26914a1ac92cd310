"""The seam between the run's event stream and experiment trackers.

:func:`tracker_entry` maps one event record to what a tracker logs: the scalars of a
committed step or an evaluation (:class:`StepScalars`), or a note of a fault, a recovery or
a checkpoint (:class:`Annotation`). It is pure: the tools' modules only write what it gives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from planaria.observe.rank_times import rank_scalars

__all__ = ["ANNOTATED", "Annotation", "StepScalars", "Tracker", "tracker_entry"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepScalars:
    """Scalars of one step, by name (``train/loss``, ``train/lr``, ``eval/<metric>``)."""

    step: int
    t: float
    values: Mapping[str, float]


@dataclass(frozen=True, kw_only=True, slots=True)
class Annotation:
    """A recovery or checkpoint event: ``kind`` (the event's name), a one-line ``text``,
    ``counter`` (the running count it adds to, e.g. ``faults_total``) and its ``total`` (the
    feed fills it in), the step (None: the feed uses the newest committed step), numeric
    ``scalars`` (``recovery/recover_s``) and the record's fields."""

    kind: str
    step: int | None
    t: float
    text: str
    counter: str
    total: int = 0
    scalars: Mapping[str, float] = field(default_factory=dict)
    fields: Mapping[str, Any] = field(default_factory=dict)


class Tracker(Protocol):
    """An experiment tracker fed from the event stream.

    Calls arrive one at a time, in event order; a call that raises disables the tracker
    (the run goes on).
    ``close`` flushes and ends the tracker's run; it is called once, also when the run fails.
    """

    name: str

    def log_scalars(self, entry: StepScalars) -> None:
        """Writes the step's scalars at ``entry.step``."""

    def log_annotation(self, note: Annotation) -> None:
        """Writes a recovery or checkpoint event in the tool's own form (text, tag, table)."""

    def close(self) -> None:
        """Flushes what is buffered and ends the tracker's run."""


# event -> (counter, fields summarised in the text, fields also logged as scalars)
ANNOTATED: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "fault": ("faults_total", ("kind", "worker", "step", "work", "message"), ()),
    "detected": ("detections_total", ("kind", "worker", "detect_s"), ("detect_s",)),
    "action": ("actions_total", ("action", "fault_id"), ()),
    "worker_refused": ("workers_refused_total", ("worker", "reason"), ()),
    "recovered": ("recoveries_total", ("fault_id", "step", "recover_s", "lost_steps"),
                  ("recover_s", "lost_steps")),
    "restore": ("restores_total", ("step", "path", "restore_s", "lost_steps"),
                ("restore_s", "lost_steps")),
    "joined": ("joins_total", ("worker", "gen", "join_s"), ("join_s",)),
    "preempt_notice": ("preemptions_total", ("worker", "source"), ()),
    "step_skipped": ("steps_skipped_total", ("reason",), ()),
    "step_overflow": ("overflows_total", ("grad_norm",), ()),
    "checkpoint_saved": ("checkpoints_saved_total", ("path", "bytes", "stall_s", "save_s"),
                         ("stall_s", "save_s")),
    "checkpoint_failed": ("checkpoint_failures_total", ("error", "reason"), ()),
    "checkpoints_failing": ("checkpoints_failing_total", ("failed", "error", "action"), ()),
    "ray_lost": ("ray_lost_total", ("process", "how"), ()),
}
_GROUP = {"fault": "recovery", "detected": "recovery", "action": "recovery",
          "worker_refused": "recovery", "recovered": "recovery", "restore": "recovery",
          "joined": "recovery", "preempt_notice": "recovery", "ray_lost": "recovery",
          "step_skipped": "train", "step_overflow": "train"}


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _int(value: Any) -> int | None:
    number = _float(value)
    return None if number is None else int(number)


def _step_scalars(record: Mapping[str, Any], step: int, t: float) -> StepScalars:
    values: dict[str, float] = {}
    for key, name in (("loss", "loss"), ("lr", "lr"), ("samples_per_s", "samples_per_s"),
                      ("grad_norm", "grad_norm"), ("duration_s", "step_s"),
                      ("width", "replicas")):
        if (v := _float(record.get(key))) is not None:
            values[f"train/{name}"] = v
    for key, value in (record.get("metrics") or {}).items():
        if (v := _float(value)) is not None:
            values[f"train/{key}"] = v
    values.update(rank_scalars(record))
    return StepScalars(step=step, t=t, values=values)


def tracker_entry(record: Mapping[str, Any]) -> StepScalars | Annotation | None:
    """What trackers log of one event record (None: nothing).

    ``step_committed`` → the step's loss, learning rate, samples/s, gradient norm, step time,
    replicas and user metrics (``train/...``; a value that is not a finite number is left
    out), and where each rank's time went (``time/rank<r>/<part>``, bounded for wide jobs:
    :func:`planaria.observe.rank_times.rank_scalars`); ``eval`` → ``eval/<metric>`` at the
    step evaluated (its ``step`` steps done) and ``eval/samples``; the events of
    :data:`ANNOTATED` → an :class:`Annotation`.
    """
    event = str(record.get("event"))
    t = _float(record.get("t")) or 0.0
    step = _int(record.get("step"))
    if event == "step_committed":
        return None if step is None else _step_scalars(record, step, t)
    if event == "eval":
        if step is None:
            return None
        values = {f"eval/{k}": v for k, val in (record.get("metrics") or {}).items()
                  if (v := _float(val)) is not None}
        if (n := _float(record.get("samples"))) is not None:
            values["eval/samples"] = n
        return StepScalars(step=step, t=t, values=values)
    if event not in ANNOTATED:
        return None
    counter, shown, numeric = ANNOTATED[event]
    fields = {k: v for k, v in record.items() if k not in ("t", "event")}
    parts = [f"{k}={fields[k]}" for k in shown if fields.get(k) is not None]
    group = _GROUP.get(event, "checkpoint")
    scalars = {f"{group}/{k}": v for k in numeric if (v := _float(fields.get(k))) is not None}
    return Annotation(kind=event, step=step, t=t, text=f"{event}: {', '.join(parts)}",
                      counter=counter, scalars=scalars, fields=fields)
