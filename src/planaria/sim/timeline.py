"""A simulated job's clock, progress and checkpoints; :mod:`planaria.sim.engine` adds
the replicas and what each strategy does.

Progress is measured in *work seconds*: the seconds the committed steps would
take at full width, so a step is ``step_s`` of work at any width. Between
events the job computes at its width's rate; the save cycles of a stretch are
counted in closed form, so a month of steps costs a few operations.
"""

from __future__ import annotations

import math

import numpy as np

from planaria.sim.failures import draw_failures
from planaria.sim.params import SimParams
from planaria.sim.result import SimResult

__all__ = ["Timeline"]

EPS = 1e-9


class Timeline:
    """Time, progress, checkpoints and the badput buckets of one simulated job."""

    def __init__(self, p: SimParams, every: float, seed: int) -> None:
        self.p, self.every = p, every
        self.R = p.replicas
        self.rng = np.random.default_rng(seed)
        self.target = p.steps * p.step_s if p.steps is not None else math.inf
        # Steps mode: far enough that a job that can finish does.
        self.end = (p.horizon_s if p.steps is None
                    else p.startup_s + 50.0 * self.target + 30 * 86_400.0)
        self.stream = draw_failures(p, self.rng, self.end)
        self.i = 0  # the next failure in the stream
        # A replayed run's failures may be given by the step in flight: they strike when
        # the job gets there, whatever its speed (docs/simulator.md).
        self.by_step = p.trace is not None and p.trace.unit == "step"
        self.t = 0.0
        self.progress = self.since = self.stall_left = 0.0
        self.ckpts: list[tuple[float, float]] = []  # (progress held, usable from), oldest first
        self.out: dict[int, float] = {}  # replica → when its replacement is ready
        self.done = False
        self.failures = self.checkpoints = 0
        self.good = 0.0
        self.bad = dict.fromkeys(SimResult.BUCKETS, 0.0)

    # ---- time -----------------------------------------------------------------------------

    def next_failure(self) -> float:
        if self.by_step:
            return self.t if self.progress >= self.fail_at() - EPS else math.inf
        return float(self.stream.times[self.i]) if self.i < len(self.stream) else math.inf

    def fail_at(self) -> float:
        """Progress at which the next failure strikes (step-given failures only)."""
        if not self.by_step or self.i >= len(self.stream):
            return math.inf
        return float(self.stream.times[self.i]) * self.p.step_s

    def spend(self, until: float, bucket: str) -> None:
        until = min(until, self.end)
        if until > self.t:
            self.bad[bucket] += until - self.t
            self.t = until

    def phases(self, phases: list[tuple[str, float]]) -> bool:
        """Spends the phases in turn; True if a failure interrupted them (not consumed)."""
        for bucket, seconds in phases:
            until = self.t + seconds
            if self.next_failure() < until:
                self.spend(self.next_failure(), bucket)
                return self.t < self.end
            self.spend(until, bucket)
        return False

    def run(self, until: float) -> None:
        """Computes at the current width up to ``until`` (or the target), saving on schedule."""
        p = self.p
        until = min(until, self.end)
        width = self.R - len(self.out)
        st = p.step_time(width)
        cycle = st + p.step_overhead_s
        speed = p.step_s / cycle
        shares = (min(st, p.step_s) / cycle, max(st - p.step_s, 0.0) / cycle)
        stall = p.ckpt_stall_s
        while self.t < until - EPS and not self.done:
            if self.stall_left > 0:
                d = min(self.stall_left, until - self.t)
                self.stall_left -= d
                self.spend(self.t + d, "checkpoint_stall")
                continue
            if self.since == 0 and math.isfinite(self.every):
                period = self.every / speed + stall
                n = math.floor((until - self.t) / period)
                limit = min(self.target, self.fail_at())
                if math.isfinite(limit):
                    n = min(n, math.ceil((limit - self.progress) / self.every - EPS) - 1)
                if n >= 1:  # whole save cycles, in closed form
                    t0, p0 = self.t, self.progress
                    self.compute(n * self.every / speed, speed, shares)
                    first = max(1, n - 2 - math.ceil(p.ckpt_write_s / period))
                    for j in range(first, n + 1):
                        start = t0 + j * self.every / speed + (j - 1) * stall
                        self.save(p0 + j * self.every, start)
                    self.checkpoints += n
                    self.bad["checkpoint_stall"] += n * stall
                    self.t = t0 + n * period
                    continue
            to_ckpt = (self.every - self.since) / speed
            to_end = (self.target - self.progress) / speed
            to_fail = (self.fail_at() - self.progress) / speed
            dt = max(min(to_ckpt, to_end, to_fail, until - self.t), 0.0)
            self.compute(dt, speed, shares)
            if to_end <= dt + EPS:
                self.progress, self.done = self.target, True
            elif to_ckpt <= dt + EPS:
                self.save(self.progress, self.t)
                self.checkpoints += 1
                self.stall_left = stall
            elif to_fail <= dt + EPS:
                return

    def compute(self, dt: float, speed: float, shares: tuple[float, float]) -> None:
        self.t += dt
        self.progress += dt * speed
        self.since = 0.0 if math.isinf(self.every) else self.since + dt * speed
        self.good += dt * shares[0]
        self.bad["reduced_width"] += dt * shares[1]
        self.bad["other"] += dt * (1.0 - shares[0] - shares[1])

    def save(self, progress: float, start: float) -> None:
        self.since = 0.0
        self.ckpts.append((progress, start + self.p.ckpt_stall_s + self.p.ckpt_write_s))
        while len(self.ckpts) > 2 and self.ckpts[1][1] <= start:
            self.ckpts.pop(0)  # a newer one is already written: the oldest can never be used

    # ---- losses ---------------------------------------------------------------------------

    def lose(self, work: float) -> None:
        work = max(min(work, self.progress), 0.0)
        moved = min(work, self.good)
        self.good -= moved
        self.bad["wasted_steps"] += moved
        self.progress -= work
        self.since = max(self.since - work, 0.0)

    def lose_step_in_flight(self) -> None:
        steps = self.progress / self.p.step_s
        self.lose((steps - math.floor(steps + EPS)) * self.p.step_s if steps > EPS else 0.0)
        self.stall_left = 0.0
        self.ckpts = [c for c in self.ckpts if c[1] <= self.t]

    def rollback(self) -> float:
        """Back to the newest checkpoint written by now; returns the work it holds."""
        usable = [c for c in self.ckpts if c[1] <= self.t]
        held = usable[-1][0] if usable else 0.0
        self.lose(self.progress - held)
        self.ckpts, self.since, self.stall_left = usable[-1:], 0.0, 0.0
        return held
