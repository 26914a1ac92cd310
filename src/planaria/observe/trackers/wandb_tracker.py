"""Weights & Biases tracker: scalars per step (against a ``step`` axis, so a step computed
again after a restore is logged again), recovery and checkpoint events as running counts,
``run.summary`` entries (``last_fault``) and an ``events`` table logged when it closes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planaria.observe.trackers.base import Annotation, StepScalars

__all__ = ["WandbTracker"]


class WandbTracker:
    """Logs to a new W&B run (``wandb.init``) with its files under ``log_dir``; ``mode``:
    ``online``, ``offline`` (sync later with ``wandb sync``) or None (wandb's settings and
    ``WANDB_MODE``)."""

    name = "wandb"

    def __init__(self, log_dir: str | Path, *, project: str = "planaria",
                 run_name: str | None = None, mode: str | None = None,
                 config: dict[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError(
                'the W&B tracker needs wandb: pip install "planaria[wandb]"'
            ) from err
        self._wandb = wandb
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        init: Any = wandb.init  # mode: a str checked by wandb, not a Literal here
        # create_new (wandb 0.19.10): a run of the caller's own stays open beside this one
        self.run: Any = init(project=project, name=run_name, dir=str(self.dir), mode=mode,
                             config=config or {}, reinit="create_new")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self._rows: list[list[Any]] = []

    def log_scalars(self, entry: StepScalars) -> None:
        self.run.log({"step": entry.step, **entry.values})

    def log_annotation(self, note: Annotation) -> None:
        self.run.log({"step": note.step, f"events/{note.counter}": note.total,
                      **note.scalars})
        self.run.summary[note.counter] = note.total
        self.run.summary[f"last_{note.kind}"] = note.text
        self._rows.append([note.step, note.t, note.kind, note.total, note.text])

    def close(self) -> None:
        if self._rows:
            table = self._wandb.Table(columns=["step", "t", "event", "total", "text"],
                                      data=self._rows)
            self.run.log({"events": table})
        self.run.finish()
