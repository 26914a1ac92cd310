"""The failures a simulated job meets: drawn per node with numpy, or replayed from a trace.

Each node is a renewal process: after a failure its slot holds a fresh node
whose next failure is drawn anew (Weibull with the given shape, scaled so its
mean is ``node_mtbf_h``; shape 1 is exponential). Preemptions are a Poisson
process per node. All of it is drawn at once and merged into one sorted stream,
so a 30-day job on thousands of nodes costs a few array operations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planaria.sim.params import SimParams

__all__ = ["FailureStream", "draw_failures"]


@dataclass(frozen=True)
class FailureStream:
    """Failures in time order: when, which replica it takes out, announced or not."""

    times: np.ndarray
    replicas: np.ndarray
    planned: np.ndarray

    def __len__(self) -> int:
        return len(self.times)


def _renewal_times(
    rng: np.random.Generator, nodes: int, mean_s: float, shape: float, horizon_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """(times, node) of all failures before ``horizon_s``, nodes as renewal processes."""
    scale = mean_s / math.gamma(1.0 + 1.0 / shape)
    expected = horizon_s / mean_s
    # Draw enough inter-arrival times per node that running out is rare; top up if not.
    per_node = max(4, int(expected + 6.0 * math.sqrt(expected + 1.0) + 4))
    times: list[np.ndarray] = []
    nodes_of: list[np.ndarray] = []
    offset = np.zeros(nodes)
    active = np.arange(nodes)
    while active.size:
        gaps = scale * rng.weibull(shape, size=(active.size, per_node))
        cum = offset[active, None] + np.cumsum(gaps, axis=1)
        inside = cum < horizon_s
        rows, _ = np.nonzero(inside)
        times.append(cum[inside])
        nodes_of.append(active[rows])
        offset[active] = cum[:, -1]
        active = active[inside[:, -1]]
    return np.concatenate(times), np.concatenate(nodes_of)


def draw_failures(params: SimParams, rng: np.random.Generator, horizon_s: float) -> FailureStream:
    """All failures up to ``horizon_s``, or the params' trace replayed."""
    if params.trace is not None:
        tr = params.trace
        order = np.argsort(np.asarray(tr.times, dtype=float), kind="stable")
        planned = np.asarray(tr.planned or [False] * len(tr.times), dtype=bool)
        return FailureStream(
            np.asarray(tr.times, dtype=float)[order],
            np.asarray(tr.replicas, dtype=np.int64)[order],
            planned[order],
        )
    t, node = _renewal_times(
        rng, params.nodes, params.node_mtbf_h * 3600.0, params.weibull_shape, horizon_s
    )
    planned = np.zeros(t.size, dtype=bool)
    if params.preempt_mtbf_h is not None:
        rate = params.nodes / (params.preempt_mtbf_h * 3600.0)
        count = rng.poisson(rate * horizon_s)
        t = np.concatenate([t, rng.uniform(0.0, horizon_s, count)])
        node = np.concatenate([node, rng.integers(0, params.nodes, count)])
        planned = np.concatenate([planned, np.ones(count, dtype=bool)])
    order = np.argsort(t, kind="stable")
    return FailureStream(t[order], node[order] // params.nodes_per_replica, planned[order])
