"""Published fleet figures as simulator inputs, and what the simulator says of them.

- Llama 3 405B pre-training (Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4):
  16,384 H100 GPUs, a 54-day snapshot, 466 job interruptions, 419 of them unexpected
  (47 planned), "higher than 90% effective training time". The paper states the
  GPUs, the days and the interruption counts; it does not state the checkpoint
  interval, the save's stall, the detection time or the restart's cost:
  :data:`LLAMA3_ASSUMED` gives the values assumed here, and docs/simulator.md the
  result's sensitivity to each.
- Meta's research clusters (Kokolis et al., "Revisiting Reliability in Large-Scale
  Machine Learning Research Clusters", HPCA 2025, arXiv:2410.21680): a job's mean
  time to failure from a per-node failure rate, ``1 / (nodes x rate)``;
  :func:`job_mttf_h` is that relation and :func:`simulated_job_mttf_h` the same
  measured on the simulator's failure stream.
"""

from __future__ import annotations

import numpy as np

from planaria.sim.failures import draw_failures
from planaria.sim.params import SimParams

__all__ = [
    "LLAMA3_ASSUMED",
    "LLAMA3_DAYS",
    "LLAMA3_GPUS",
    "LLAMA3_PLANNED",
    "LLAMA3_UNEXPECTED",
    "job_mttf_h",
    "llama3_405b",
    "node_mtbf_h_for",
    "simulated_job_mttf_h",
]

LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54.0
LLAMA3_UNEXPECTED = 419
LLAMA3_PLANNED = 466 - 419

LLAMA3_ASSUMED: dict[str, float] = {
    "step_s": 10.0,  # not stated; the result barely depends on it
    "detect_s": 60.0,  # a collective timeout or health check notices the loss
    "restart_s": 300.0,  # relaunch on healthy nodes, rendezvous, communicator setup
    "restore_s": 60.0,  # ~6.5 TB of model and optimizer state read back in parallel
    "ckpt_stall_s": 10.0,  # training blocked per save (snapshot; written in the background)
    "ckpt_write_s": 120.0,  # the background write, usable only once written
    "replacement_s": 0.0,  # a restart goes on spare nodes: it does not wait for a repair
    "preempt_notice_s": 600.0,  # planned interruptions announce themselves: a save first
}
"""Inputs the Llama 3 paper does not state, as assumed here (docs/simulator.md shows the
result's sensitivity to each)."""


def node_mtbf_h_for(failures: float, nodes: int, days: float) -> float:
    """The mean time between failures of one node that gives ``failures`` in ``days`` on
    ``nodes`` nodes."""
    return days * 24.0 * nodes / failures


def job_mttf_h(gpus: int, failures_per_1000_node_days: float, gpus_per_node: int = 8) -> float:
    """A job's mean time to failure when each of its nodes fails at this rate, independently."""
    nodes = gpus / gpus_per_node
    return 24.0 / (nodes * failures_per_1000_node_days / 1000.0)


def simulated_job_mttf_h(params: SimParams, seed: int = 0) -> float:
    """The mean gap between the unexpected failures the simulator draws for ``params``'s job
    (its whole horizon), in hours."""
    stream = draw_failures(params.with_(preempt_mtbf_h=None), np.random.default_rng(seed),
                           params.horizon_s)
    return params.horizon_s / max(len(stream), 1) / 3600.0


def llama3_405b(**changes: float) -> SimParams:
    """Llama 3 405B's job: 2,048 nodes of 8 GPUs, 54 days, the published interruption
    counts as failure rates, :data:`LLAMA3_ASSUMED` for the rest (``changes`` override)."""
    nodes = LLAMA3_GPUS // 8
    return SimParams(
        nodes=nodes,
        gpus_per_node=8,
        node_mtbf_h=node_mtbf_h_for(LLAMA3_UNEXPECTED, nodes, LLAMA3_DAYS),
        preempt_mtbf_h=node_mtbf_h_for(LLAMA3_PLANNED, nodes, LLAMA3_DAYS),
        days=LLAMA3_DAYS,
    ).with_(**{**LLAMA3_ASSUMED, **changes})
