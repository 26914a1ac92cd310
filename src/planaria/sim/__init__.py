"""A fleet-scale simulator: which recovery strategy and checkpoint interval a job should use.

``simulate`` runs one job; ``plan`` searches each strategy's best interval and
recommends one; ``params_from_run`` calibrates the figures from a real run's
event log. See docs/simulator.md.
"""

from planaria.sim.engine import simulate
from planaria.sim.params import STRATEGIES, FailureTrace, SimParams, Strategy
from planaria.sim.result import SimResult

__all__ = ["STRATEGIES", "FailureTrace", "SimParams", "SimResult", "Strategy", "simulate"]
