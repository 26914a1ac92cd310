"""The worker's side of checkpoints (snapshot its share, write it in the background, load)."""

from __future__ import annotations

__all__ = ["CheckpointWorkerMixin"]


class CheckpointWorkerMixin:
    """Mixed into :class:`planaria.worker.Worker`; methods are called by the controller's Checkpointer."""
