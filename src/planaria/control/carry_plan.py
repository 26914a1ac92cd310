"""A step resumed after a fault: each survivor keeps the micro-batches it finished, only
the rest is computed again.

When a run fails at step s and no survivor applied s, each survivor reports the
micro-batches of s whose gradient sum it kept (``Settled.held``, see
:mod:`planaria.worker.kept_work`). The next run, at the new width, starts at s: every
survivor keeps what it holds, and the micro-batches nobody holds (the dead ranks' share,
and any a survivor had not run) are split over the new generation's ranks, joiners
included, near-equal and whole. :func:`plan_carry` is that rule, without Ray;
:class:`HeldSteps` collects the reports of a failed run and hands the plan to the next
run that starts at the step they hold.

Nothing is carried (the whole step is computed again) where no survivor holds the step
the next run starts at: a survivor applied it (the run went on past it), the state was
restored from a checkpoint, or the survivors could not keep their part (the worker's
own fall-backs: a sharded replica, module buffers, fp16's loss scaler).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planaria.data.plan import micro_batch_range
from planaria.wire.reports import CarriedStep, HeldWork, Settled

__all__ = ["CarryPlan", "HeldSteps", "plan_carry"]


@dataclass(frozen=True, kw_only=True)
class CarryPlan:
    """Step ``step`` resumed: each member's part (``shares``, by name); ``kept``, the
    micro-batches whose gradient survivors kept; ``redone``, those computed now;
    ``unstarted``, those of them a survivor had not begun when the step failed (so
    ``redone - unstarted`` bounds the work the fault lost: the dead ranks' share);
    ``total``, the step's micro-batches."""

    step: int
    shares: Mapping[str, CarriedStep]
    kept: int
    redone: int
    total: int
    unstarted: int = 0


def plan_carry(step: int, held: Mapping[str, HeldWork], members: Sequence[str],
               total: int) -> CarryPlan | None:
    """The plan of step ``step`` (``total`` micro-batches) over ``members`` (rank order),
    each keeping what ``held`` says it holds of that step; None when none holds any."""
    kept = {name: h.micro_batches for name, h in held.items()
            if name in members and h.step == step and h.micro_batches}
    taken = [j for part in kept.values() for j in part]
    if not taken or len(set(taken)) != len(taken) or not all(0 <= j < total for j in taken):
        return None
    held_now = set(taken)
    rest = [j for j in range(total) if j not in held_now]
    shares: dict[str, CarriedStep] = {}
    for rank, name in enumerate(members):
        first, count = micro_batch_range(len(rest), len(members), rank)
        shares[name] = CarriedStep(step=step, kept=tuple(sorted(kept.get(name, ()))),
                                   new=tuple(rest[first : first + count]))
    unstarted = {j for name, h in held.items() if name in members and h.step == step
                 for j in h.unstarted} - held_now
    return CarryPlan(step=step, shares=shares, kept=len(taken), redone=len(rest), total=total,
                     unstarted=len(unstarted))


class HeldSteps:
    """What the survivors of the last failed run hold, until the next run (see the module
    doc); ``total``: a step's micro-batches."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.step = -1
        self.held: dict[str, HeldWork] = {}

    def settled(self, answers: Mapping[str, Settled], committed: int) -> None:
        """A failed run's survivors answered; ``committed``: the steps done from now on. Only
        those that did not apply the step past it (every one at ``committed``) count."""
        self.step = committed
        self.held = {name: a.held for name, a in answers.items()
                     if a.held is not None and a.steps_done == committed
                     and a.held.step == committed}

    def take(self, start: int, members: Sequence[str]) -> CarryPlan | None:
        """The plan for a run that starts at ``start`` over ``members``, once: a later run
        gets none (what the survivors held is gone or moved on by then)."""
        held, step = self.held, self.step
        self.held, self.step = {}, -1
        if not held or start != step:
            return None
        return plan_carry(step, held, members, self.total)
