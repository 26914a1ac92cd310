"""When to save: a fixed number of steps, a fixed duration, or Young/Daly's optimum."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CheckpointInterval", "young_daly_interval"]


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum of the compute time between checkpoints, in seconds.

    With δ = ``checkpoint_s`` (the time a checkpoint costs the job) and M =
    ``mtbf_s``: τ = sqrt(2δM)·[1 + (1/3)·sqrt(δ/(2M)) + (1/9)·(δ/(2M))] - δ
    for δ < 2M, else τ = M (J. T. Daly, "A higher order estimate of the optimum
    checkpoint interval for restart dumps", FGCS 22, 2006, eq. 37). It refines
    Young's sqrt(2δM). The formula reproduces the paper's worked cases
    directly: δ = 5 min gives 116.7 min for M = 24 h, 56.7 min for M = 6 h and
    9.14 min for M = 15 min.
    """
    if checkpoint_s < 0 or not math.isfinite(checkpoint_s):
        raise ValueError(f"checkpoint_s must be a finite number >= 0, got {checkpoint_s}")
    if mtbf_s <= 0 or not math.isfinite(mtbf_s):
        raise ValueError(f"mtbf_s must be a finite number > 0, got {mtbf_s}")
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(kw_only=True)
class CheckpointInterval:
    """Decides after which steps to save. Exactly one of ``every_steps``, ``every_s`` or
    ``auto`` is set. ``step`` below counts the steps done (after step ``s`` commits,
    ``s + 1``); ``now`` is seconds on any clock the caller keeps (injectable)."""

    every_steps: int | None = None
    """Save every this many steps."""
    every_s: float | None = None
    """Save when this many seconds have passed since the last save."""
    auto: bool = False
    """Save at Daly's optimum from the measured stall and the failure rate."""
    mtbf_prior_s: float = 24 * 3600.0
    """Auto: the job's mean time between failures assumed before any is observed."""
    stall_prior_s: float = 1.0
    """Auto: the checkpoint stall assumed before one is measured."""
    min_steps: int = 1
    """Auto: never save more often than this."""
    max_steps: int | None = None
    """Auto: never save less often than this (None: no bound)."""
    continuous: bool = False
    """Auto: when Daly's optimum is shorter than a save takes to write and commit, save
    back to back (continuous checkpointing) instead of at the write time."""

    _failures: int = field(default=0, init=False, repr=False)
    _exposure_s: float = field(default=0.0, init=False, repr=False)
    _stall_s: float | None = field(default=None, init=False, repr=False)
    _save_s: float | None = field(default=None, init=False, repr=False)
    _step_s: float | None = field(default=None, init=False, repr=False)
    _last_step: int = field(default=0, init=False, repr=False)
    _last_t: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        modes = (self.every_steps is not None) + (self.every_s is not None) + bool(self.auto)
        if modes != 1:
            raise ValueError("set exactly one of every_steps, every_s or auto=True")
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {self.every_steps}")
        if self.every_s is not None and not self.every_s > 0:
            raise ValueError(f"every_s must be > 0, got {self.every_s}")
        if not self.mtbf_prior_s > 0 or self.stall_prior_s < 0:
            raise ValueError("mtbf_prior_s must be > 0 and stall_prior_s >= 0")
        if self.min_steps < 1 or (self.max_steps is not None and self.max_steps < self.min_steps):
            raise ValueError("need 1 <= min_steps <= max_steps")

    @classmethod
    def from_spec(cls, spec: int | float | str, **auto_options: Any) -> CheckpointInterval:
        """``500`` or ``"500"``: every 500 steps; ``"90s"``, ``"10m"``, ``"2h"``: a duration;
        ``"auto"``: Daly's optimum (``auto_options`` go to the constructor)."""
        if isinstance(spec, bool):
            raise ValueError(f"bad checkpoint interval {spec!r}")
        if isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit()):
            return cls(every_steps=int(spec))
        if isinstance(spec, str) and spec.strip().lower() == "auto":
            return cls(auto=True, **auto_options)
        m = _DURATION_RE.match(spec) if isinstance(spec, str) else None
        if m is None:
            raise ValueError(f"bad checkpoint interval {spec!r}: use steps, '10m' or 'auto'")
        return cls(every_s=float(m.group(1)) * _UNIT_S[m.group(2)])

    # ---- observations ------------------------------------------------------------------

    def observe_failure(self) -> None:
        """A failure happened: the failure-rate estimate goes up."""
        self._failures += 1

    def observe_stall(self, seconds: float) -> None:
        """A save blocked training for ``seconds``."""
        self._stall_s = seconds if self._stall_s is None else 0.5 * self._stall_s + 0.5 * seconds

    def observe_save_time(self, seconds: float) -> None:
        """A save took ``seconds`` from its snapshot to its commit (writes included)."""
        self._save_s = seconds if self._save_s is None else 0.5 * self._save_s + 0.5 * seconds

    @property
    def save_s(self) -> float | None:
        """The measured time from a save's snapshot to its commit (None before one)."""
        return self._save_s

    def observe_step_time(self, seconds: float, steps: int = 1) -> None:
        """``steps`` steps took ``seconds`` (also counts as time exposed to failures)."""
        self._exposure_s += seconds
        per = seconds / max(1, steps)
        self._step_s = per if self._step_s is None else 0.8 * self._step_s + 0.2 * per

    def mark_saved(self, step: int, now: float) -> None:
        """A save was taken after ``step`` steps, at ``now``."""
        self._last_step, self._last_t = step, now

    # ---- decisions ---------------------------------------------------------------------

    @property
    def mtbf_s(self) -> float:
        """Estimated MTBF: the prior counts as one failure in ``mtbf_prior_s`` seconds."""
        return (self.mtbf_prior_s + self._exposure_s) / (1 + self._failures)

    @property
    def stall_s(self) -> float:
        return self.stall_prior_s if self._stall_s is None else self._stall_s

    def interval_s(self) -> float | None:
        """Seconds of training between saves (None for a fixed step count)."""
        if self.every_s is not None:
            return self.every_s
        if self.auto:
            optimum = young_daly_interval(self.stall_s, self.mtbf_s)
            if self._save_s is not None and optimum < self._save_s:
                # Saving more often than a save takes only queues saves behind each other.
                return 0.0 if self.continuous else self._save_s
            return optimum
        return None

    def steps(self) -> int | None:
        """Steps between saves now (None while an auto or duration interval has no step time)."""
        if self.every_steps is not None:
            return self.every_steps
        seconds = self.interval_s()
        if seconds is None or not self._step_s:
            return None
        n = max(1, round(seconds / self._step_s))
        if self.auto:
            n = max(self.min_steps, n)
            if self.max_steps is not None:
                n = min(n, self.max_steps)
        return n

    def should_save(self, step: int, now: float) -> bool:
        """True if a save is due after ``step`` steps at time ``now``. Does not record the
        save: call :meth:`mark_saved` when one is taken."""
        if step <= self._last_step:
            return False
        if self._last_t is None:
            self._last_t = now  # durations count from the first question
        if self.every_steps is not None:
            return step % self.every_steps == 0
        if self.every_s is not None:
            return now - self._last_t >= self.every_s
        n = self.steps()
        if n is not None:
            return step - self._last_step >= n
        return now - self._last_t >= (self.interval_s() or 0.0)

    def next_due_step(self, step: int) -> int | None:
        """The step count after ``step`` at which a save falls due by step count; None when
        saves fall due by time (see :meth:`due_by_time`)."""
        if self.every_steps is not None:
            return (step // self.every_steps + 1) * self.every_steps
        if self.every_s is None:
            n = self.steps()
            if n is not None:
                return max(step + 1, self._last_step + n)
        return None

    def due_by_time(self, now: float) -> bool:
        """True if a save decided by time (``every_s``, or auto before a step time is known)
        is due at ``now``."""
        if self._last_t is None:
            return False
        if self.every_s is not None:
            return now - self._last_t >= self.every_s
        if self.auto and self.steps() is None:
            return now - self._last_t >= (self.interval_s() or 0.0)
        return False

    def describe(self) -> dict[str, Any]:
        """Fields of the ``checkpoint_interval`` event: ``every_steps``, ``reason`` and inputs."""
        reason = "fixed" if self.every_steps is not None else (
            "duration" if self.every_s is not None else "auto")
        out: dict[str, Any] = {"every_steps": self.steps(), "reason": reason,
                               "every_s": self.interval_s(), "step_s": self._step_s}
        if self.auto:
            out.update(stall_s=self.stall_s, mtbf_s=self.mtbf_s, failures=self._failures,
                       save_s=self._save_s, continuous=self.continuous)
        return out
