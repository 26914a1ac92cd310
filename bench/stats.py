"""The benches' statistics, fixed before any run: medians and paired ratios over repeats,
with percentile-bootstrap 95 % intervals, and the rule that says whether a claim holds.

- :func:`median_ci`: the median of per-run figures, its interval from resampling the runs.
- :func:`paired_ratio`: two systems measured in the same repeats (side by side, the same
  kill seed); the figure is the median of the per-repeat ratios, and each bootstrap
  resample draws repeat *indices* and keeps both systems' runs of a drawn repeat together,
  so what the repeat shared (the machine's state, the kills) cancels in the ratio.
- :func:`ahead` / :func:`met`: a claim holds only where the whole interval is on its side.

The bootstrap is the percentile one with a fixed seed (``SEED``) and ``RESAMPLES``
resamples, so that the same records always give the same interval. With few repeats the
interval is as wide as the runs are apart: that is the point.
"""

from __future__ import annotations

import operator
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LEVEL",
    "RESAMPLES",
    "SEED",
    "Estimate",
    "ahead",
    "bootstrap",
    "median_ci",
    "met",
    "paired_ratio",
]

SEED = 20260
RESAMPLES = 4000
LEVEL = 0.95


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """A figure over repeats and its bootstrap interval (None where nothing was measured)."""

    median: float | None
    ci95: tuple[float, float] | None
    n: int
    """How many repeats (or runs) it is taken over."""

    def as_dict(self, digits: int = 4) -> dict[str, Any]:
        """``{"median", "ci95": [lo, hi], "n"}``, rounded, for a result's JSON."""
        return {"median": None if self.median is None else round(self.median, digits),
                "ci95": None if self.ci95 is None else [round(x, digits) for x in self.ci95],
                "n": self.n}


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def bootstrap(n: int, statistic: Callable[[list[int]], float], *, resamples: int = RESAMPLES,
              seed: int = SEED, level: float = LEVEL) -> tuple[float, float]:
    """The percentile interval of ``statistic`` over ``resamples`` draws of ``n`` indices
    with replacement (``statistic`` gets the drawn indices, so it can keep paired values
    together)."""
    if n < 1:
        raise ValueError("bootstrap needs at least one value")
    rng = random.Random(seed)
    draws = sorted(statistic([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return _quantile(draws, tail), _quantile(draws, 1.0 - tail)


def _measured(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None]


def median_ci(values: Sequence[float | None], **kw: Any) -> Estimate:
    """The median of the measured values (None ones left out) and its bootstrap interval."""
    xs = _measured(values)
    if not xs:
        return Estimate(median=None, ci95=None, n=0)
    ci = bootstrap(len(xs), lambda idx: statistics.median(xs[i] for i in idx), **kw)
    return Estimate(median=statistics.median(xs), ci95=ci, n=len(xs))


def paired_ratio(numerators: Sequence[float | None], denominators: Sequence[float | None],
                 **kw: Any) -> Estimate:
    """The median over repeats of ``numerators[i] / denominators[i]``, with the paired
    bootstrap interval (repeat indices resampled; a repeat where either side has no
    figure, or the denominator is 0, is left out)."""
    if len(numerators) != len(denominators):
        raise ValueError("paired figures need one value per repeat on each side")
    ratios = [a / b for a, b in zip(numerators, denominators, strict=True)
              if a is not None and b]
    if not ratios:
        return Estimate(median=None, ci95=None, n=0)
    ci = bootstrap(len(ratios), lambda idx: statistics.median(ratios[i] for i in idx), **kw)
    return Estimate(median=statistics.median(ratios), ci95=ci, n=len(ratios))


MIN_FOR_CLAIM = 3
"""Fewer measured values than this support no claim: a bootstrap interval of one or two
values is not an interval (one value's is the value itself)."""


def ahead(estimate: Estimate, parity: float = 1.0) -> bool | None:
    """A ratio is "ahead" only if its interval's low end is above ``parity``; None where
    nothing was measured, or fewer than :data:`MIN_FOR_CLAIM` values were."""
    if estimate.ci95 is None or estimate.n < MIN_FOR_CLAIM:
        return None
    return estimate.ci95[0] > parity


def met(estimate: Estimate, target: float, direction: str) -> bool | None:
    """A target is "met" only if the whole interval is on its side: ``">="``/``">"`` want the
    low end at (above) the target, ``"<="``/``"<"`` the high end; None where nothing was
    measured, or fewer than :data:`MIN_FOR_CLAIM` values were."""
    if direction not in _SIDES:
        raise ValueError(f"direction {direction!r}: one of {sorted(_SIDES)}")
    if estimate.ci95 is None or estimate.n < MIN_FOR_CLAIM:
        return None
    end, compare = _SIDES[direction]
    return compare(estimate.ci95[end], target)


_SIDES = {">=": (0, operator.ge), ">": (0, operator.gt), "<=": (1, operator.le),
          "<": (1, operator.lt)}
"""A direction of :func:`met`: the interval's end it looks at (0 low, 1 high), and how."""
