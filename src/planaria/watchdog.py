"""The hang watchdog's deadline, learned from observed step times."""

from __future__ import annotations

from collections import deque
from typing import Any

from planaria.policy import HangConfig

__all__ = ["StepDeadline"]


class StepDeadline:
    """deadline = clamp(factor x slowest recent step, floor, ceiling); before any step: the ceiling.

    The learned window is part of the job's state (``state_dict``) so a restored
    job does not start from the ceiling again.
    """

    def __init__(self, config: HangConfig) -> None:
        self.config = config
        self._recent: deque[float] = deque(maxlen=config.window)

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
        return {"recent": list(self._recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._recent = deque(state.get("recent", []), maxlen=self.config.window)
