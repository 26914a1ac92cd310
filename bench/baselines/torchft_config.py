"""One torchft configuration, as the benches run it and name it in their results.

The goodput and recovery benches run torchft at the configuration its sweep found best
(``bench/results/torchft_best.json``, written by the sweep): both benches name the same
configuration beside every ratio. The fields are torchft's own knobs (its lighthouse's
heartbeat timeout and quorum tick, its gloo timeout, its asynchronous quorum) and how a
killed group's replacement starts (a fresh Python, or a standby process started ahead).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["BEST_PATH", "TorchftConfig", "load_best"]

BEST_PATH = Path(__file__).resolve().parents[1] / "results" / "torchft_best.json"
"""Where the sweep writes its best configuration (``{"config": {...}, ...}``)."""


@dataclass(frozen=True, kw_only=True)
class TorchftConfig:
    """How torchft runs in a bench."""

    heartbeat_ms: int = 250
    """The lighthouse's ``--heartbeat_timeout_ms``: how soon a dead group leaves the quorum."""
    quorum_tick_ms: int = 100
    """The lighthouse's ``--quorum_tick_ms``: how often it forms a quorum."""
    pg_timeout_s: float | None = None
    """The gloo collectives' timeout; None: 10 x the fault-free step, at least 2 s."""
    async_quorum: bool = True
    """torchft's asynchronous quorum (a replacement heals during its first step)."""
    warm_standby: bool = False
    """A killed group's replacement is a process started ahead (torch imported, model
    built) that waits to be needed, as planaria's spare; False: a fresh Python."""

    def label(self) -> str:
        """A short name for tables: ``hb250 tick100 pg2.0 async``."""
        pg = "auto" if self.pg_timeout_s is None else f"{self.pg_timeout_s:g}"
        return (f"hb{self.heartbeat_ms} tick{self.quorum_tick_ms} pg{pg} "
                f"{'async' if self.async_quorum else 'sync'}"
                f"{' standby' if self.warm_standby else ''}")

    def as_dict(self) -> dict[str, Any]:
        """The fields, for a result's JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TorchftConfig:
        """Back from :meth:`as_dict`; unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown torchft config keys {unknown}; known: {sorted(known)}")
        return cls(**d)


def load_best(path: Path = BEST_PATH) -> TorchftConfig:
    """The sweep's best configuration; the defaults where no sweep has run (say so)."""
    if not path.exists():
        return TorchftConfig()
    return TorchftConfig.from_dict(json.loads(path.read_text())["config"])
