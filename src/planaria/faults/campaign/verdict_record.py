"""A campaign's verdicts as records: a bound (a measured number against its limit), one
fault's verdict and one run's, and their JSON form (``verdict.json`` and the campaign's
``campaign-record-*.jsonl`` hold them; a record is judged again from its files).

The bounds (:data:`BOUNDS`) are described in :mod:`planaria.faults.campaign.verdict`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BOUNDS", "COMMIT_S", "DETECT_S", "NOTICE_S", "RECOVERY_SLACK_S", "STALL_SLACK_S",
           "Bound", "FaultVerdict", "RunVerdict"]

BOUNDS = ("detect_0.5s", "kill_recovered", "lost_steps", "notice_to_snapshot_1s",
          "stall_evicted", "link_evicted", "commit_0.2s")
DETECT_S = 0.5
NOTICE_S = 1.0
COMMIT_S = 0.2
STALL_SLACK_S = 5.0
RECOVERY_SLACK_S = 1.0
"""Beyond detection, one step and the replacement's start: the new generation's group and
the scheduling of the re-run step on a loaded machine."""


@dataclass
class Bound:
    name: str
    value: float | None
    """What was measured (None: what it bounds never happened, a violation)."""
    limit: float
    what: str = ""

    @property
    def ok(self) -> bool:
        return self.value is not None and self.value <= self.limit + 1e-9

    def describe(self) -> str:
        got = "never" if self.value is None else f"{self.value:.3f}"
        return f"{self.name}: {got} > {self.limit:.3f} ({self.what})"


@dataclass
class FaultVerdict:
    run: int
    fault: int
    kind: str
    step_s: float
    injected: bool = False
    recovered: bool = False
    """A recovery kind: recovered; a tolerated kind: tolerated (nothing lost, no one evicted)."""
    tolerated: bool = False
    """A kind that needs no recovery (counted apart)."""
    detect_s: float | None = None
    recover_s: list[float] = field(default_factory=list)
    lost_steps: int | None = None
    bounds: list[Bound] = field(default_factory=list)
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    """What the report got wrong without the fault going unrecovered (a wrong kind)."""
    in_run: bool | None = None
    """It fired while an autonomous run of steps was in flight (not a step dispatched alone)."""
    skipped: str | None = None
    """Why it was not injected on purpose (a tmpfs that could not be mounted)."""
    figures: dict[str, float] = field(default_factory=dict)
    """Measured, with no bound: ``end_s`` (a fault of Ray's own processes: the kill to the
    end of the job's process), ``restart_s`` (a kill in a start: the kill to the next
    replacement or spare ready)."""
    outcome: str = ""
    """A fault of Ray's own processes: whether the job ended (and was started again) or
    outlived it and finished."""

    @property
    def violations(self) -> list[Bound]:
        return [b for b in self.bounds if not b.ok]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FaultVerdict:
        bounds = [Bound(**b) for b in data.pop("bounds", [])]
        return cls(**data, bounds=bounds)


@dataclass
class RunVerdict:
    index: int
    run_dir: Path
    step_s: float
    completed: bool
    faults: list[FaultVerdict] = field(default_factory=list)
    diverged: bool = False
    duplicated: int = 0
    missing: int = 0
    healthy_evicted: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    goodput_s: float = 0.0
    wall_s: float = 0.0
    bounds: list[Bound] = field(default_factory=list)
    """The run's own bounds (``commit_0.2s``, per save)."""
    processes_left: list[str] = field(default_factory=list)
    shape: str = ""

    @property
    def ok(self) -> bool:
        return not self.reasons

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["run_dir"] = str(self.run_dir)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunVerdict:
        data = dict(data)
        faults = [FaultVerdict.from_json(dict(f)) for f in data.pop("faults")]
        bounds = [Bound(**b) for b in data.pop("bounds", [])]
        return cls(**{**data, "run_dir": Path(data["run_dir"]), "faults": faults,
                      "bounds": bounds})
