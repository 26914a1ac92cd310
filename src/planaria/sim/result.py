"""What one simulated job did with its wall time: goodput and badput by bucket."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["SimResult"]


@dataclass(kw_only=True)
class SimResult:
    """Seconds per bucket; ``goodput_s`` + sum(``badput_s``) == ``wall_s``.

    The buckets are :data:`planaria.observe.goodput.BUCKETS`' names where they mean the
    same, plus ``reduced_width``: the extra step time while a resized job runs
    below full width (the event log counts such steps as goodput; the
    simulator counts only the full-width share).
    """

    BUCKETS: ClassVar[tuple[str, ...]] = (
        "startup",
        "checkpoint_stall",
        "restore",
        "recovery",
        "wasted_steps",
        "waiting_for_replicas",
        "downtime",
        "reduced_width",
        "other",
    )

    strategy: str
    interval_s: float | None
    """Compute seconds between saves (None: no saves)."""
    wall_s: float
    goodput_s: float
    badput_s: dict[str, float] = field(default_factory=dict)
    failures: int = 0
    checkpoints: int = 0
    steps: float = 0.0
    """Steps done and kept."""

    @property
    def goodput(self) -> float:
        return self.goodput_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def badput(self) -> dict[str, float]:
        w = self.wall_s
        return {k: (v / w if w > 0 else 0.0) for k, v in self.badput_s.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "goodput": self.goodput,
            "interval_s": self.interval_s,
            "badput": self.badput,
            "wall_s": self.wall_s,
            "failures": self.failures,
            "checkpoints": self.checkpoints,
        }
