"""What a failed run leaves committed: the rule alone, without Ray.

A run ends in failure with its survivors at different steps: a step's reduction may have
completed on some ranks and not on others. A survivor that applied a step saw its
reduction complete, so every rank computed it: the furthest survivor's steps are
committed, and the survivors behind it receive the state in the next generation.
:func:`reconcile` applies that rule to the survivors' answers (``Worker.settle_run``);
:class:`~planaria.control.run_ahead.RunAhead` gathers them and records the outcome, and
a takeover (:mod:`planaria.control.takeover`) counts steps by the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planaria.wire.reports import Settled, StepRecord

__all__ = ["Reconciled", "reconcile"]


@dataclass(frozen=True, kw_only=True)
class Reconciled:
    """A failed run's outcome: ``committed``, the steps done from now on (at least the
    run's start); ``applied``, the furthest survivor's records of the run's steps below
    ``committed`` (what to commit, in step order); ``behind``, the survivors that did not
    reach ``committed`` (in ``members``' order): they no longer hold the state."""

    committed: int
    applied: tuple[StepRecord, ...]
    behind: tuple[str, ...]


def reconcile(answers: Mapping[str, Settled], *, start: int,
              members: Sequence[str]) -> Reconciled:
    """The outcome of a run that started at step ``start`` and failed, from the survivors'
    ``answers`` (by name; a member with no answer was lost). ``members``: the generation's
    workers in rank order."""
    committed = max([start, *(a.steps_done for a in answers.values())])
    ahead = next((a for a in answers.values() if a.steps_done == committed), None)
    applied = () if ahead is None else tuple(
        rec for rec in ahead.steps if start <= rec.step < committed)
    behind = tuple(name for name in members
                   if name in answers and answers[name].steps_done < committed)
    return Reconciled(committed=committed, applied=applied, behind=behind)
