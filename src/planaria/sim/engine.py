"""The discrete-event core: one job, one strategy, one checkpoint interval, one seed.

Time advances from event to event (a failure, a replacement joining, the end),
never step by step: between events the job computes at the rate its width
allows, and the checkpoints in a stretch are counted in closed form. Progress
is measured in *work seconds*: the seconds the committed steps would take at
full width, so a step is ``step_s`` of work at any width.

What each strategy does when a replica is lost (docs/simulator.md):

- ``restart``: back to the newest written checkpoint; detect, wait until every
  node is back (``downtime``), restart the job (``startup``), restore.
- ``restore``: back to the checkpoint; detect and tear down (``recovery``), wait
  for the replacement (``waiting_for_replicas``), restore in-process.
- ``pause``: the survivors hold the state; only the step in flight is lost.
  Detect, wait for the replacement and its join at full stop.
- ``resize``: only the step in flight is lost; after detect and a rebuild the
  survivors go on at reduced width (``reduced_width``: the extra step time);
  the replacement joins live, costing ``join_stall_s``.

When no replica is left that holds state, pause and resize fall back to a restore.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from planaria.sim.failures import draw_failures
from planaria.sim.params import STRATEGIES, SimParams, Strategy
from planaria.sim.result import SimResult

__all__ = ["simulate"]

_EPS = 1e-9


class _Job:
    def __init__(self, p: SimParams, strategy: Strategy, every: float, seed: int) -> None:
        self.p, self.strategy, self.every = p, strategy, every
        self.R = p.replicas
        self.rng = np.random.default_rng(seed)
        work = p.steps * p.step_s if p.steps is not None else math.inf
        self.target = work
        self.end = p.horizon_s if p.steps is None else p.startup_s + 50.0 * work + 30 * 86_400.0
        self.stream = draw_failures(p, self.rng, self.end)
        self.i = 0
        self.t = 0.0
        self.progress = self.since = self.stall_left = 0.0
        self.ckpts: list[tuple[float, float]] = []  # (progress held, usable from), oldest first
        self.out: dict[int, float] = {}  # replica → when its replacement is ready
        self.pool = p.spares
        self.refills: list[float] = []
        self.done = False
        self.failures = self.checkpoints = 0
        self.good = 0.0
        self.bad = dict.fromkeys(SimResult.BUCKETS, 0.0)

    # ---- time -----------------------------------------------------------------------------

    def next_failure(self) -> float:
        return float(self.stream.times[self.i]) if self.i < len(self.stream) else math.inf

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
        while self.t < until - _EPS and not self.done:
            if self.stall_left > 0:
                d = min(self.stall_left, until - self.t)
                self.stall_left -= d
                self.spend(self.t + d, "checkpoint_stall")
                continue
            if self.since == 0 and math.isfinite(self.every):
                period = self.every / speed + stall
                n = math.floor((until - self.t) / period)
                if math.isfinite(self.target):
                    n = min(n, math.ceil((self.target - self.progress) / self.every - _EPS) - 1)
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
            dt = min(to_ckpt, to_end, until - self.t)
            self.compute(dt, speed, shares)
            if to_end <= dt + _EPS:
                self.progress, self.done = self.target, True
            elif to_ckpt <= dt + _EPS:
                self.save(self.progress, self.t)
                self.checkpoints += 1
                self.stall_left = stall

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
        self.lose((steps - math.floor(steps + _EPS)) * self.p.step_s if steps > _EPS else 0.0)
        self.stall_left = 0.0
        self.ckpts = [c for c in self.ckpts if c[1] <= self.t]

    def rollback(self) -> float:
        """Back to the newest checkpoint written by now; returns the work it holds."""
        usable = [c for c in self.ckpts if c[1] <= self.t]
        held = usable[-1][0] if usable else 0.0
        self.lose(self.progress - held)
        self.ckpts, self.since, self.stall_left = usable[-1:], 0.0, 0.0
        return held

    # ---- replicas -------------------------------------------------------------------------

    def replacement_time(self, t: float) -> float:
        p = self.p
        while self.refills and self.refills[0] <= t:
            heapq.heappop(self.refills)
            self.pool += 1
        sample = p.replacement_s
        if p.replacement_cv > 0:
            sigma2 = math.log1p(p.replacement_cv**2)
            sample = float(self.rng.lognormal(math.log(p.replacement_s) - sigma2 / 2, sigma2**0.5))
        if self.pool > 0:
            self.pool -= 1
            heapq.heappush(self.refills, t + sample)
            return p.spare_swap_s
        return sample

    def take_failure(self) -> tuple[int, bool, bool]:
        """Consumes the next failure: (replica, planned, it was in service)."""
        p = self.p
        t = float(self.stream.times[self.i])
        replica, planned = int(self.stream.replicas[self.i]), bool(self.stream.planned[self.i])
        self.i += 1
        self.failures += 1
        asked = t - p.preempt_notice_s if planned else t + p.detect_s
        ready = max(asked + self.replacement_time(t), t)
        in_service = replica not in self.out
        self.out[replica] = max(self.out.get(replica, ready), ready)
        return replica, planned, in_service

    def ready_time(self, need: int) -> float:
        """When at least ``need`` replicas are in service."""
        short = len(self.out) - (self.R - need)
        return self.t if short <= 0 else sorted(self.out.values())[short - 1]

    def back_in_service(self) -> None:
        self.out = {r: ready for r, ready in self.out.items() if ready > self.t + _EPS}

    # ---- strategies -----------------------------------------------------------------------

    def stop_and_restore(self, *, need: int, detect: float) -> None:
        """Rolls back to a checkpoint, waits for ``need`` replicas, (restarts,) restores."""
        p = self.p
        restart = self.strategy == "restart"
        held = self.rollback()
        wait_bucket = "downtime" if restart else "waiting_for_replicas"
        first = [("recovery", detect)]
        while True:
            after = self.t + sum(s for _, s in first)
            plan = [*first, (wait_bucket, max(self.ready_time(need) - after, 0.0))]
            if restart:
                plan.append(("startup", p.restart_s))
            if held > 0:
                plan.append(("restore", p.restore_s))
            if not self.phases(plan):
                break
            self.take_failure()
            first = []
        self.back_in_service()

    def on_failure(self) -> None:
        p = self.p
        _, planned, in_service = self.take_failure()
        if not in_service:
            return
        if self.strategy in ("restart", "restore"):
            if planned and p.preempt_notice_s >= p.ckpt_stall_s + p.ckpt_write_s:
                self.stall_left = 0.0
                self.spend(self.t + p.ckpt_stall_s, "checkpoint_stall")
                self.ckpts = [(self.progress, self.t)]  # saved just in time
                self.checkpoints += 1
            detect = 0.0 if planned else p.detect_s + (p.rebuild_s if self.strategy == "restore"
                                                     else 0.0)
            self.stop_and_restore(need=self.R, detect=detect)
            return
        drained = planned and p.preempt_notice_s >= p.step_time(self.R - len(self.out) + 1)
        if not drained:
            self.lose_step_in_flight()
        if self.strategy == "pause":
            self.pause(0.0 if drained else p.detect_s)
        else:
            self.resize((0.0 if drained else p.detect_s) + p.rebuild_s)

    def pause(self, detect: float) -> None:
        first = [("recovery", detect)]
        while len(self.out) < self.R:
            after = self.t + detect if first else self.t
            wait = max(self.ready_time(self.R) - after, 0.0)
            plan = [*first, ("waiting_for_replicas", wait),
                    ("waiting_for_replicas", self.p.join_stall_s)]
            if not self.phases(plan):
                self.back_in_service()
                return
            self.take_failure()
            first = []
        self.stop_and_restore(need=self.R, detect=0.0)

    def resize(self, recovery: float) -> None:
        while len(self.out) < self.R:
            if not self.phases([("recovery", recovery)]):
                return
            self.take_failure()
            recovery = self.p.rebuild_s
        self.stop_and_restore(need=1, detect=0.0)

    def join(self) -> None:
        self.back_in_service()
        self.phases([("recovery", self.p.join_stall_s)])

    def simulate(self) -> None:
        self.spend(self.p.startup_s, "startup")  # failures meanwhile are handled after it
        while self.t < self.end - _EPS and not self.done:
            nf = self.next_failure()
            nj = min(self.out.values()) if self.out and self.strategy == "resize" else math.inf
            self.run(min(nf, nj))
            if self.done or self.t >= self.end - _EPS:
                break
            if nj <= nf:
                self.join()
            else:
                self.on_failure()
        if self.done:
            self.bad["other"] += self.p.shutdown_s
            self.t += self.p.shutdown_s


def simulate(
    params: SimParams, strategy: Strategy, *, interval_s: float | None, seed: int = 0
) -> SimResult:
    """Simulates one job. ``interval_s``: compute seconds between saves (rounded to whole
    steps at full width), None for no checkpoints."""
    from planaria.errors import ConfigError

    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy={strategy!r} is not valid: one of {', '.join(STRATEGIES)}")
    if interval_s is not None and not (math.isfinite(interval_s) and interval_s > 0):
        raise ConfigError(f"interval_s={interval_s!r} is not valid: seconds > 0, or None")
    every = (
        math.inf if interval_s is None
        else max(1, round(interval_s / params.step_s)) * params.step_s
    )
    job = _Job(params, strategy, every, seed)
    job.simulate()
    return SimResult(
        strategy=strategy,
        interval_s=None if math.isinf(every) else every,
        wall_s=job.t,
        goodput_s=job.good,
        badput_s=job.bad,
        failures=job.failures,
        checkpoints=job.checkpoints,
        steps=job.progress / params.step_s,
    )
