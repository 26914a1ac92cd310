"""What the simulator is told about a job: its size, its failure rates and what recovery costs.

Times are seconds unless a name says otherwise. Defaults are round figures for a
large GPU job; :func:`planaria.sim.calibrate.params_from_run` measures them
from a real run instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from planaria.config import check

__all__ = ["STRATEGIES", "FailureTrace", "SimParams", "Strategy"]

Strategy = Literal["restart", "restore", "pause", "resize"]
STRATEGIES: tuple[Strategy, ...] = ("restart", "restore", "pause", "resize")


def _nonneg(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def _pos(value: Any) -> bool:
    return _nonneg(value) and value > 0


@dataclass(frozen=True, kw_only=True)
class FailureTrace:
    """Failures replayed instead of drawn: ``(t, replica)`` pairs, t in seconds from the
    job's start, or with ``unit="step"`` the step in flight (the failure strikes when the
    job gets there); ``planned`` marks departures announced ahead (preemptions)."""

    times: tuple[float, ...]
    replicas: tuple[int, ...]
    planned: tuple[bool, ...] = ()
    unit: Literal["s", "step"] = "s"

    def __post_init__(self) -> None:
        check(len(self.times) == len(self.replicas), "replicas", self.replicas,
              "one replica per failure time")
        check(not self.planned or len(self.planned) == len(self.times), "planned",
              self.planned, "empty, or one flag per failure time")
        check(all(_nonneg(t) for t in self.times), "times", self.times, "seconds >= 0")
        check(self.unit in ("s", "step"), "unit", self.unit, "'s' or 'step'")
        check(all(isinstance(r, int) and r >= 0 for r in self.replicas), "replicas",
              self.replicas, "replica indices >= 0")


@dataclass(frozen=True, kw_only=True)
class SimParams:
    """One training job on ``nodes`` nodes; a replica is ``nodes_per_replica`` nodes."""

    nodes: int
    """Nodes in the job (without spares)."""
    gpus_per_node: int = 8
    nodes_per_replica: int = 1
    """Nodes that hold one data-parallel replica together: one node's failure takes it out."""
    node_mtbf_h: float = 50_000.0
    """Mean time between unexpected failures of one node, hours."""
    weibull_shape: float = 1.0
    """Shape of each node's failure process: 1 is exponential; below 1, infant mortality."""
    preempt_mtbf_h: float | None = None
    """Mean time between planned preemptions of one node, hours (None: none)."""
    preempt_notice_s: float = 30.0
    """Warning a preemption gives: enough for a save or a drain when it covers one."""
    step_s: float = 10.0
    """Step time at full width (the part the event log counts as a step's duration)."""
    step_overhead_s: float = 0.0
    """Time between steps that is no step (controller round trip): badput ``other``."""
    width_exponent: float = 1.0
    """Step time at width w is ``step_s * (full / w) ** width_exponent`` (1: compute-bound)."""
    step_s_by_width: tuple[tuple[int, float], ...] = ()
    """Measured step times ``(width, seconds)`` that override the exponent."""
    detect_s: float = 30.0
    """Failure → the job knows."""
    rebuild_s: float = 10.0
    """Survivors build a new process group (resize) or tear the old one down (restore)."""
    replacement_s: float = 600.0
    """Replacement asked for → ready (scheduling, node boot, model build); mean."""
    replacement_cv: float = 0.0
    """Coefficient of variation of the replacement time (lognormal; 0: fixed)."""
    spares: int = 0
    """Hot-spare nodes: a failed node is swapped for one in ``spare_swap_s``; the pool
    refills after ``replacement_s``."""
    spare_swap_s: float = 60.0
    join_stall_s: float = 5.0
    """The pause a hot-join costs the running job (state transfer, new group)."""
    restart_s: float = 300.0
    """A full job restart (torchrun): requeue, process start, rendezvous; badput ``startup``."""
    restore_s: float = 120.0
    """Reading and loading a checkpoint."""
    ckpt_stall_s: float = 10.0
    """A save blocks training this long (snapshot to host memory)."""
    ckpt_write_s: float = 60.0
    """After the stall, the background write; the checkpoint is usable only once written."""
    startup_s: float = 0.0
    """The job's first start, until its first step."""
    shutdown_s: float = 0.0
    """After the last step until the job ends (final save, teardown): badput ``other``."""
    days: float = 30.0
    """Wall time simulated (the job's length), unless ``steps`` is set."""
    steps: int | None = None
    """Run until this many steps are done instead of for ``days``."""
    trace: FailureTrace | None = field(default=None, repr=False)
    """Replay these failures instead of drawing them."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "nodes_per_replica"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, value, "an integer >= 1")
        check(self.nodes % self.nodes_per_replica == 0, "nodes", self.nodes,
              f"a multiple of nodes_per_replica={self.nodes_per_replica}")
        for name in ("node_mtbf_h", "weibull_shape", "step_s", "days"):
            value = getattr(self, name)
            check(_pos(value), name, value, "a finite number > 0")
        for name in ("preempt_notice_s", "step_overhead_s", "width_exponent", "detect_s",
                     "rebuild_s", "replacement_s", "replacement_cv", "spare_swap_s",
                     "join_stall_s", "restart_s", "restore_s", "ckpt_stall_s", "ckpt_write_s",
                     "startup_s", "shutdown_s"):
            value = getattr(self, name)
            check(_nonneg(value), name, value, "a finite number >= 0")
        check(self.preempt_mtbf_h is None or _pos(self.preempt_mtbf_h), "preempt_mtbf_h",
              self.preempt_mtbf_h, "hours > 0, or None for no preemptions")
        check(isinstance(self.spares, int) and self.spares >= 0, "spares", self.spares,
              "an integer >= 0")
        check(self.steps is None or (isinstance(self.steps, int) and self.steps >= 1), "steps",
              self.steps, "an integer >= 1, or None to run for `days`")
        for width, sec in self.step_s_by_width:
            check(isinstance(width, int) and 1 <= width <= self.replicas and _pos(sec),
                  "step_s_by_width", self.step_s_by_width,
                  f"(width, seconds) pairs with 1 <= width <= {self.replicas}, seconds > 0")
        if self.trace is not None:
            bad = [r for r in self.trace.replicas if r >= self.replicas]
            check(not bad, "trace", bad, f"replica indices below replicas={self.replicas}")

    @property
    def replicas(self) -> int:
        return self.nodes // self.nodes_per_replica

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def horizon_s(self) -> float:
        return self.days * 86_400.0

    @property
    def job_mtbf_s(self) -> float:
        """Mean time between unexpected failures anywhere in the job."""
        return self.node_mtbf_h * 3600.0 / self.nodes

    def step_time(self, width: int) -> float:
        """Seconds per step at ``width`` live replicas (the global batch stays fixed)."""
        measured = dict(self.step_s_by_width)
        if width in measured:
            return measured[width]
        return self.step_s * (self.replicas / width) ** self.width_exponent

    def with_(self, **changes: Any) -> SimParams:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)
