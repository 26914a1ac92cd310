"""Experiment trackers (TensorBoard, W&B, MLflow, CSV) fed from the run's event stream."""

from planaria.observe.trackers.base import Annotation, StepScalars, Tracker, tracker_entry
from planaria.observe.trackers.factory import (
    TRACKER_NAMES,
    TrackerOptions,
    build_tracker,
    build_trackers,
    parse_names,
)
from planaria.observe.trackers.feed import TrackerFeed

__all__ = [
    "TRACKER_NAMES",
    "Annotation",
    "StepScalars",
    "Tracker",
    "TrackerFeed",
    "TrackerOptions",
    "build_tracker",
    "build_trackers",
    "parse_names",
    "tracker_entry",
]
