"""The discrete-event core: one job, one strategy, one checkpoint interval, one seed.

Time advances from event to event (a failure, a replacement joining, the end),
never step by step (:class:`planaria.sim.timeline.Timeline` computes between
events).

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

from planaria.sim.params import STRATEGIES, SimParams, Strategy
from planaria.sim.result import SimResult
from planaria.sim.timeline import EPS, Timeline

__all__ = ["simulate"]


class _Job(Timeline):
    def __init__(self, p: SimParams, strategy: Strategy, every: float, seed: int) -> None:
        super().__init__(p, every, seed)
        self.strategy = strategy
        self.pool = p.spares
        self.refills: list[float] = []  # when used spares come back to the pool

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
        t = self.t if self.by_step else float(self.stream.times[self.i])
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
        self.out = {r: ready for r, ready in self.out.items() if ready > self.t + EPS}

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
        while self.t < self.end - EPS and not self.done:
            nf = self.next_failure()
            nj = min(self.out.values()) if self.out and self.strategy == "resize" else math.inf
            self.run(min(nf, nj))
            if self.done or self.t >= self.end - EPS:
                break
            if nj <= self.next_failure():
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
    from planaria.faults.errors import ConfigError

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
