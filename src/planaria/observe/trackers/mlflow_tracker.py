"""MLflow tracker: scalars as metrics per step, recovery and checkpoint events as running
counts (``faults_total``), tags (``planaria.last_fault``) and one text artifact
(``planaria_events.txt``, written when the tracker closes)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from planaria.observe.trackers.base import Annotation, StepScalars

__all__ = ["MlflowTracker"]


def _tracking_uri(target: str | Path) -> str:
    """A URI as given; a local path as a file store (MLflow 3 keeps file stores in
    maintenance: they are allowed here, for a local run's tracking directory)."""
    text = str(target)
    if "://" in text or text.startswith(("file:", "sqlite:", "databricks")):
        if text.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return text
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return Path(text).resolve().as_uri()


class MlflowTracker:
    """Logs to a new MLflow run in ``experiment`` at ``tracking_uri`` (a URI, or a local
    directory used as a file store); ``run_name``: the run's name (planaria's run id)."""

    name = "mlflow"

    def __init__(self, tracking_uri: str | Path, *, experiment: str = "planaria",
                 run_name: str | None = None, tags: dict[str, str] | None = None) -> None:
        try:
            from mlflow.entities import Metric
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise ImportError(
                'the MLflow tracker needs mlflow: pip install "planaria[mlflow]"'
            ) from err
        self._metric = Metric
        self.uri = _tracking_uri(tracking_uri)
        self.client: Any = MlflowClient(self.uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (found.experiment_id if found is not None
                         else self.client.create_experiment(experiment))
        all_tags = dict(tags or {})
        if run_name:
            all_tags["mlflow.runName"] = run_name
        self.run_id: str = self.client.create_run(experiment_id, tags=all_tags).info.run_id
        self._lines: list[str] = []

    def _log(self, values: dict[str, float], step: int, t: float) -> None:
        ms = int(t * 1000) or int(time.time() * 1000)
        metrics = [self._metric(key=k, value=v, timestamp=ms, step=step)
                   for k, v in values.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def log_scalars(self, entry: StepScalars) -> None:
        self._log(dict(entry.values), entry.step, entry.t)

    def log_annotation(self, note: Annotation) -> None:
        step = note.step or 0
        self._log({note.counter: float(note.total), **note.scalars}, step, note.t)
        self.client.set_tag(self.run_id, f"planaria.last_{note.kind}", note.text[:5000])
        self._lines.append(f"step {step}\t{note.text}")

    def close(self) -> None:
        if self._lines:
            self.client.log_text(self.run_id, "\n".join(self._lines) + "\n",
                                 "planaria_events.txt")
        self.client.set_terminated(self.run_id)
