"""The replica's side of the commit protocol (invariant 1): a pending step is applied or
dropped, never half.

From the moment a step starts, the gradient counts as *pending*: a step that fails
anywhere (a peer died mid-allreduce) is dropped by the next :meth:`Commits.settle`,
never applied and never accumulated into the next one, and the module buffers its
forward passes changed go back to their committed values. A step the controller
(or the run) counts as done is applied. A *hold* (``ckpt_freeze``) keeps every step
from a given one on pending, unapplied, so that a snapshot taken beside the
training thread sees the same committed step on every replica.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from planaria.faults.errors import PlanariaError, StepAborted
from planaria.faults.user_code import user_call
from planaria.wire.reports import Hold
from planaria.worker import memory_reserve
from planaria.worker.membership import Membership
from planaria.worker.optimizer_layout import (
    StatePlace,
    claim_region_for_state,
    move_state_into,
    prebuild_by_probe,
)
from planaria.worker.replica_state import ReplicaState
from planaria.worker.vitals import Vitals

__all__ = ["Commits"]

_log = logging.getLogger("planaria.worker")


class Commits:
    """Steps done, the pending step, and how a pending step is applied or dropped."""

    def __init__(self, name: str, state: ReplicaState, membership: Membership,
                 vitals: Vitals) -> None:
        self.name = name
        self.state = state
        self.membership = membership
        self.vitals = vitals
        self.steps_done = 0
        self.pending: int | None = None
        self.grad_norm = 0.0  # the pending step's reduced gradient's
        self.hold = threading.Condition(state.lock)
        self.hold_below: int | None = None  # while set, no step at or past it is applied
        self.place_for_state: StatePlace | None = None  # see claim_state_region

    def reset(self) -> None:
        """Back to no step done (the state was built again)."""
        self.pending = None
        self.steps_done = 0

    def settle(self, steps_done: int, skipped: int = -1, *, allow_behind: bool = False) -> None:
        """The controller (or the run) counts ``steps_done`` steps committed: the pending
        step is applied if it is the last of them, dropped otherwise; ``skipped`` (a
        non-finite step the controller dropped) counts as done without its update."""
        if self.pending is not None:
            if self.pending == steps_done - 1 and self.pending == skipped:
                self.drop_pending()  # done, without its update
                self.steps_done += 1
            elif self.pending == steps_done - 1:
                self.apply()
            else:
                self.drop_pending()
        if self.steps_done != steps_done and not allow_behind:
            raise PlanariaError(
                f"{self.name} has {self.steps_done} steps done, the controller {steps_done}"
            )

    def wait_while_held(self) -> None:
        """Under a hold, the pending step waits here, unapplied, until the hold lets it pass
        (:meth:`advance`, :meth:`release`) or the generation is aborted (it is then
        dropped)."""
        with self.hold:
            while (self.hold_below is not None and self.pending is not None
                   and self.pending >= self.hold_below):
                if self.membership.aborted:
                    raise StepAborted(f"{self.name} dropped held step {self.pending}: the "
                                      "generation was aborted")
                self.vitals.set_phase("held", self.pending)
                self.hold.wait(0.05)

    def apply(self) -> None:
        self.wait_while_held()
        self.state.await_incoming()  # a received state's optimizer part: all of it first
        self.state.wait_readers()  # a save's copy, a send, still reads the state: they go first
        with self.state.lock:
            self._apply_locked()

    def _apply_locked(self) -> None:
        state = self.state
        self.vitals.set_phase("apply", self.pending if self.pending is not None else -1)
        clip = state.spec.grad_clip_norm
        if state.scaler is not None:
            user_call("GradScaler.unscale_", state.scaler.unscale_, state.optimizer)
        if clip is not None and math.isfinite(self.grad_norm):
            # torch's clip_grad_norm_, with the norm computed after the reduce
            coef = min(1.0, clip / (self.grad_norm + 1e-6))
            if coef < 1.0:
                for flat in state.reducer.gradients():
                    flat.mul_(coef)
        if state.scaler is not None:  # skips the update on an overflow, then backs off the scale
            user_call("optimizer.step", state.scaler.step, state.optimizer)
            state.scaler.update()
        else:
            user_call("optimizer.step", state.optimizer.step)
        if state.scheduler is not None:
            user_call("lr_scheduler.step", state.scheduler.step)
        if self.place_for_state is not None and state.optimizer.state:
            move_state_into(state.optimizer, self.place_for_state)  # once: ~0.1 s at 1 GB
            self.place_for_state = None
        state.buffer_sync.commit()
        self.drop_pending()
        self.steps_done += 1

    def drop_pending(self) -> None:
        """The gradient goes, and the module buffers back to their committed values."""
        self.state.reducer.zero()
        with self.state.lock:
            if self.pending is not None:
                self.state.buffer_sync.rollback()
            self.pending = None

    def place_optimizer_state(self, reserve: str | None, *, joiner: bool) -> str | None:
        """At the setup: a joiner's optimizer state made ahead (:meth:`prebuild_optimizer_state`),
        another worker's region claimed for it (:meth:`claim_state_region`); returns where a
        region's memory came from (``"recycled"``, ``"new"``; None: none)."""
        if joiner:
            return self.prebuild_optimizer_state(reserve)
        return None if reserve is None else self.claim_state_region(reserve)

    def claim_state_region(self, reserve: str) -> str | None:
        """A worker that is not a joiner: claims (off the steps' path) a region of the
        node's shared memory for the optimizer state its first step makes, which moves
        into it then (:func:`~planaria.worker.optimizer_layout.move_state_into`); returns
        where the region's memory came from (``"recycled"``, ``"new"``; None: none). So
        every worker that dies leaves its optimizer state's memory to the next joiner on
        its node, not only a joiner that dies: a region taken fresh costs a joiner's setup
        2-4 CPU-seconds more than a recycled one (``realistic`` size, 2 cores), taken
        from the steps beside it whatever its priority (a fresh page is a fault on the
        host too)."""
        place = claim_region_for_state(
            self.state.optimizer, lambda nbytes: memory_reserve.claim(nbytes, reserve))
        self.place_for_state = place
        return None if place is None else ("recycled" if place.region.recycled else "new")

    def prebuild_optimizer_state(self, reserve: str | None = None) -> str | None:
        """Creates the optimizer's state tensors (exp_avg, ...), so that a state received or
        restored lands in memory already allocated and touched: as a probe of the optimizer
        shows them (:mod:`planaria.worker.optimizer_layout`; ``reserve``, a job's tag: in a
        region of the node's shared memory, a dead worker's if there is one, see
        :mod:`planaria.worker.memory_reserve`), else by one optimizer step on zero gradients.
        Returns where a region's memory came from (``"recycled"``, ``"new"``; None: none).

        The step may move the parameters (weight decay): no matter, they are all overwritten.
        """
        self.state.wait_readers()
        claimed: list[memory_reserve.Region] = []

        def region_for(nbytes: int) -> memory_reserve.Region | None:
            region = None if reserve is None else memory_reserve.claim(nbytes, reserve)
            claimed.extend([region] if region is not None else [])
            return region

        if prebuild_by_probe(self.state.optimizer, region_for):
            return ("recycled" if claimed[0].recycled else "new") if claimed else None
        self.state.reducer.gradients()  # zeros: an optimizer skips parameters with no gradient
        try:
            self.state.optimizer.step()
        except Exception:  # e.g. an optimizer that needs a closure: received into fresh memory
            _log.debug("%s could not pre-build optimizer state", self.name, exc_info=True)
        self.drop_pending()
        return None

    # ---- a hold: a save beside the steps ------------------------------------------------------

    def freeze(self) -> Hold:
        """No step from now on is applied until :meth:`advance` or :meth:`release`."""
        with self.hold:
            self.hold_below = self.steps_done
            return Hold(steps_done=self.steps_done)

    def advance(self, to: int, timeout_s: float) -> Hold:
        """Lets the steps before ``to`` be applied and waits (bounded) until they are."""
        end = time.monotonic() + timeout_s
        with self.hold:
            self.hold_below = to
            self.hold.notify_all()
            while self.steps_done < to and time.monotonic() < end:
                if self.membership.aborted:
                    break
                self.hold.wait(0.02)
            return Hold(steps_done=self.steps_done)

    def release(self) -> None:
        with self.hold:
            self.hold_below = None
            self.hold.notify_all()
