"""Each strategy at its best checkpoint interval, and which strategy to use.

The interval search evaluates a log-spaced grid around Daly's optimum (¼x to
64x), then refines around the best point by golden-section search
in log space. Every candidate runs on the same seeds, so the comparison is of
intervals, not of luck (common random numbers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from planaria.checkpoint.interval import young_daly_interval
from planaria.sim.engine import simulate
from planaria.sim.params import STRATEGIES, SimParams, Strategy
from planaria.sim.result import SimResult

__all__ = ["Plan", "StrategyPlan", "best_interval", "daly_interval", "evaluate", "plan"]

_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(kw_only=True)
class StrategyPlan:
    """One strategy at one interval, averaged over seeds."""

    strategy: str
    interval_s: float | None
    goodput: float
    badput: dict[str, float] = field(default_factory=dict)
    failures: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"goodput": self.goodput, "interval_s": self.interval_s, "badput": self.badput,
                "failures": self.failures}


def daly_interval(params: SimParams) -> float:
    """Daly's optimum for the job's failure rate, at least one step."""
    stall = max(params.ckpt_stall_s, 1e-3)
    return max(young_daly_interval(stall, params.job_mtbf_s), params.step_s)


def evaluate(
    params: SimParams, strategy: Strategy, interval_s: float | None, seeds: Sequence[int]
) -> StrategyPlan:
    """The mean of ``simulate`` over ``seeds``."""
    runs: list[SimResult] = [simulate(params, strategy, interval_s=interval_s, seed=s)
                             for s in seeds]
    n = len(runs)
    return StrategyPlan(
        strategy=strategy,
        interval_s=runs[0].interval_s,
        goodput=sum(r.goodput for r in runs) / n,
        badput={k: sum(r.badput[k] for r in runs) / n for k in SimResult.BUCKETS},
        failures=sum(r.failures for r in runs) / n,
    )


def best_interval(
    params: SimParams, strategy: Strategy, *, seeds: Sequence[int] = (0, 1, 2), refine: int = 10
) -> StrategyPlan:
    """The strategy at the interval with the highest mean goodput. Where only whole-job
    loss makes a save useful (pause, resize) the curve is flat and the longest interval
    tried (64x Daly's) tends to win: saves are still needed against losing the job."""
    cache: dict[int, StrategyPlan] = {}

    def at(interval: float) -> StrategyPlan:
        key = max(1, round(interval / params.step_s))
        if key not in cache:
            cache[key] = evaluate(params, strategy, interval, seeds)
        return cache[key]

    daly = daly_interval(params)
    longest = params.horizon_s if params.steps is None else params.steps * params.step_s
    grid = sorted({min(max(daly * 2 ** (k / 2), params.step_s), longest) for k in range(-4, 13)})
    best = max(grid, key=lambda x: at(x).goodput)
    if refine > 0:
        i = grid.index(best)
        lo, hi = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, len(grid) - 1)])
        a, b = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
        for _ in range(refine):
            if at(math.exp(a)).goodput >= at(math.exp(b)).goodput:
                hi, b = b, a
                a = hi - _GOLDEN * (hi - lo)
            else:
                lo, a = a, b
                b = lo + _GOLDEN * (hi - lo)
        best = max([best, math.exp(a), math.exp(b)], key=lambda x: at(x).goodput)
    return at(best)


@dataclass(kw_only=True)
class Plan:
    """Every strategy at its best interval, the recommendation and the reason."""

    strategies: dict[str, StrategyPlan]
    recommended: str
    why: str
    daly_interval_s: float
    job_mtbf_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "strategies": {k: v.to_json() for k, v in self.strategies.items()},
            "recommended": self.recommended,
            "why": self.why,
            "daly_interval_s": self.daly_interval_s,
            "job_mtbf_h": self.job_mtbf_s / 3600.0,
        }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _top(sp: StrategyPlan) -> str:
    name, value = max(sp.badput.items(), key=lambda kv: kv[1])
    return f"{_pct(value)} to {name}" if value > 0 else "nothing"


def _why(ranked: list[StrategyPlan]) -> str:
    best = ranked[0]
    every = ("no checkpoints" if best.interval_s is None
             else f"a checkpoint every {best.interval_s / 3600:.2g} h")
    parts = [f"{best.strategy} keeps {_pct(best.goodput)} goodput with {every}; "
             f"its largest loss is {_top(best)}"]
    for other in ranked[1:]:
        gap = 100 * (best.goodput - other.goodput)
        parts.append(f"{other.strategy} is {gap:.1f} points lower, losing {_top(other)}")
    if len(ranked) > 1 and best.goodput - ranked[1].goodput < 0.001:
        parts.append(f"{best.strategy} and {ranked[1].strategy} are within 0.1 points: "
                     "choose the simpler one")
    return "; ".join(parts)


def plan(
    params: SimParams,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    strategies: Sequence[Strategy] = STRATEGIES,
    refine: int = 10,
) -> Plan:
    """Each strategy at its best interval; the one with the highest goodput is recommended."""
    found: dict[str, StrategyPlan] = {
        s: best_interval(params, s, seeds=seeds, refine=refine) for s in strategies
    }
    ranked = sorted(found.values(), key=lambda sp: -sp.goodput)
    return Plan(strategies=found, recommended=ranked[0].strategy, why=_why(ranked),
                daly_interval_s=daly_interval(params), job_mtbf_s=params.job_mtbf_s)
