"""Trackers by name (``fit(loggers=["tensorboard", ...])``, ``--log-to``), each writing under
its own folder of ``RUN_DIR/trackers/`` unless told otherwise."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from planaria.observe.trackers.base import Tracker

__all__ = ["TRACKER_NAMES", "TrackerOptions", "build_tracker", "build_trackers", "parse_names"]

TRACKER_NAMES = ("tensorboard", "wandb", "mlflow", "csv")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrackerOptions:
    """Where and how the named trackers write. ``log_dir``: their root (None:
    ``RUN_DIR/trackers``), one folder per tracker under it; ``project``: the W&B project and
    MLflow experiment; ``run_name``: the run's name in W&B and MLflow; ``mlflow_uri``: an
    MLflow tracking URI (None: a file store in the mlflow folder); ``wandb_mode``:
    ``online``, ``offline`` or None (wandb's own settings)."""

    log_dir: Path | None = None
    project: str = "planaria"
    run_name: str | None = None
    mlflow_uri: str | None = None
    wandb_mode: str | None = None


def parse_names(text: str) -> list[str]:
    """``"tensorboard,csv"`` as names, each checked."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    for name in names:
        _check(name)
    return names


def _check(name: str) -> None:
    if name not in TRACKER_NAMES:
        raise ValueError(f"unknown tracker {name!r}: use one of {', '.join(TRACKER_NAMES)}")


def build_tracker(name: str, run_dir: Path, options: TrackerOptions) -> Tracker:
    """The tracker ``name`` (one of :data:`TRACKER_NAMES`); its library is imported now (an
    ImportError names the extra to install)."""
    _check(name)
    folder = (options.log_dir or run_dir / "trackers") / name
    if name == "csv":
        from planaria.observe.trackers.csv_tracker import CsvTracker

        return CsvTracker(folder)
    if name == "tensorboard":
        from planaria.observe.trackers.tensorboard_tracker import TensorBoardTracker

        return TensorBoardTracker(folder)
    if name == "mlflow":
        from planaria.observe.trackers.mlflow_tracker import MlflowTracker

        return MlflowTracker(options.mlflow_uri or folder, experiment=options.project,
                             run_name=options.run_name)
    from planaria.observe.trackers.wandb_tracker import WandbTracker

    return WandbTracker(folder, project=options.project, run_name=options.run_name,
                        mode=options.wandb_mode)


def build_trackers(loggers: Sequence[str | Tracker], run_dir: Path,
                   options: TrackerOptions | None = None) -> list[Tracker]:
    """Each of ``loggers``: a name is built (:func:`build_tracker`), a tracker kept as is.
    If one cannot be built, those built already are closed and the error raised."""
    opts = options or TrackerOptions(run_name=run_dir.name)
    built: list[Tracker] = []
    try:
        for logger in loggers:
            built.append(build_tracker(logger, run_dir, opts) if isinstance(logger, str)
                         else logger)
    except BaseException:
        for tracker in built:
            tracker.close()
        raise
    return built
