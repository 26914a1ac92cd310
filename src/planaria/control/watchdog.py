"""The hang watchdog's deadline, learned from observed step times."""

from __future__ import annotations

from collections import deque
from typing import Any

from planaria.control.policy import HangConfig

__all__ = ["StepDeadline"]


class StepDeadline:
    """deadline = clamp(factor x slowest recent step, floor, ceiling); before any step: the ceiling.

    The learned window is part of the job's state (``state_dict``) so a restored
    job does not start from the ceiling again. Step times are learned at a width:
    each rank's work scales with 1/width (the global batch is fixed), so when the
    width changes the window is rescaled by old/new width rather than reused as is,
    and a window saved at another width is rescaled when it is loaded.
    """

    def __init__(self, config: HangConfig) -> None:
        self.config = config
        self._recent: deque[float] = deque(maxlen=config.window)
        self.width: int | None = None

    def rescale(self, width: int) -> None:
        """The job now runs at ``width`` replicas."""
        if self.width is not None and width != self.width and width > 0:
            factor = self.width / width
            self._recent = deque((t * factor for t in self._recent), maxlen=self.config.window)
        self.width = width

    def observe(self, step_s: float) -> None:
        self._recent.append(step_s)

    def reset(self) -> None:
        """Forget what was learned (the width changed a lot, or a generation is new)."""
        self._recent.clear()

    @property
    def seconds(self) -> float:
        c = self.config
        if not self._recent:
            return c.ceiling_s
        return min(c.ceiling_s, max(c.floor_s, c.factor * max(self._recent)))

    @property
    def typical_step_s(self) -> float | None:
        if not self._recent:
            return None
        ordered = sorted(self._recent)
        return ordered[len(ordered) // 2]

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self._recent), "width": self.width}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads a saved window, rescaled to the current width (a window saved without its
        width is not trusted: the deadline starts from the ceiling again)."""
        saved_width = state.get("width")
        if not isinstance(saved_width, int) or saved_width < 1:
            self._recent.clear()
            return
        width = self.width or saved_width
        factor = saved_width / width
        self._recent = deque(
            (float(t) * factor for t in state.get("recent", [])), maxlen=self.config.window
        )
        self.width = width
