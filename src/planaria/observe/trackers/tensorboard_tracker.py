"""TensorBoard tracker: scalars per step, recovery and checkpoint events as text summaries
(``events/<event>``) and their running counts as scalars (``events/faults_total``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planaria.observe.trackers.base import Annotation, StepScalars

__all__ = ["TensorBoardTracker"]


class TensorBoardTracker:
    """Writes TensorBoard event files under ``log_dir`` (``tensorboard --logdir LOG_DIR``)."""

    name = "tensorboard"

    def __init__(self, log_dir: str | Path, *, flush_secs: int = 5) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                'the TensorBoard tracker needs tensorboard: pip install "planaria[tensorboard]"'
            ) from err
        self.dir = Path(log_dir)
        self._writer: Any = SummaryWriter(log_dir=str(self.dir), flush_secs=flush_secs)

    def log_scalars(self, entry: StepScalars) -> None:
        for key, value in entry.values.items():
            self._writer.add_scalar(key, value, global_step=entry.step, walltime=entry.t)

    def log_annotation(self, note: Annotation) -> None:
        self._writer.add_text(f"events/{note.kind}", note.text, global_step=note.step,
                              walltime=note.t)
        self._writer.add_scalar(f"events/{note.counter}", note.total, global_step=note.step,
                                walltime=note.t)
        for key, value in note.scalars.items():
            self._writer.add_scalar(key, value, global_step=note.step, walltime=note.t)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
