"""A controller's state rebuilt from the live workers and the run dir: what a controller
that comes back after dying needs to take the workers over under a new lease epoch.

:func:`rebuild` is pure: the workers' reports (:meth:`Worker.describe
<planaria.worker.actor.Worker.describe>`) and the run dir's record
(:func:`~planaria.control.run_record.read_run_record`) in, a :class:`Takeover` out, or
:class:`TakeoverRefused` naming what does not fit. Its rules are the controller's own:

- **One run.** Every worker that was told a lease follows the run the run dir's event log
  started last, and the ledger, if any, was last written by a run that log started.
- **Members** are the workers of the newest generation any of them entered, in rank
  order; that generation is at least the run dir's newest, and where it is that one,
  its members are among those the run dir names. Workers of older generations were
  evicted from the newest (*stale*: fence them); those that never joined stand by.
  The members were told one lease, and hold distinct ranks (one whose group never
  formed has none: it goes last).
- **Steps** follow the reconciliation after a failed run (:mod:`planaria.control.run_ahead`):
  a step a member applied completed its reduction on every rank, so the furthest
  member's steps are committed, the run dir's record being behind when the controller
  died before recording them (``unrecorded``: their ledger records are not in the run dir);
  a pending step no member applied is dropped at the next join. The run dir may be ahead
  by one step only where its last record skips that step (a non-finite loss) before the
  workers learnt of it: it counts as done, and the next join drops it everywhere.
- **Holders** of the state are the members whose state is whole and has the committed
  steps (in the skip case: the skipped step pending). The others are *behind* and receive
  the state in the next generation, as survivors of a broken collective and joiners do. A
  member is at most one step behind the furthest (a run's last collective completed on
  some ranks only) unless it never received the state (no step applied) or its state is
  not whole (a restore that failed part-way); anything else is refused.
- The **next generation** is greater than any a worker or the run dir names (the ledger
  keys attempts by run and generation), and the **lease epoch** greater than any told or
  recorded: joins under it fence off the controller taken over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planaria.control.run_record import RunRecord
from planaria.faults.errors import ElasticRuntimeError
from planaria.wire.takeover import WorkerReport

__all__ = ["Takeover", "TakeoverRefused", "rebuild"]


class TakeoverRefused(ElasticRuntimeError):
    """The workers and the run dir do not describe one run a controller can take over."""


@dataclass(frozen=True, kw_only=True)
class Takeover:
    """The controller's state, rebuilt (see the module doc)."""

    run_id: str
    lease_epoch: int
    """The taking-over controller's: greater than any seen."""
    next_gen: int
    """The generation its first build makes."""
    members: tuple[str, ...]
    """Rank order."""
    holders: tuple[str, ...]
    """Members that hold the committed state."""
    behind: tuple[str, ...]
    """Members that receive it in the next generation."""
    stale: tuple[str, ...]
    """Live workers evicted from the newest generation."""
    standby: tuple[str, ...]
    """Live workers that never joined a generation."""
    steps_done: int
    last_skipped: int
    skipped_samples: frozenset[int]
    unrecorded: tuple[int, ...]
    """Committed steps the run dir has no record of (the controller died first)."""
    ledger_steps: int | None
    """The steps the run dir's ledger holds committed (None: no ledger)."""


def rebuild(reports: Sequence[WorkerReport], run: RunRecord) -> Takeover:
    """The controller's state from the live workers' ``reports`` and the run dir's ``run``
    record; :class:`TakeoverRefused` if they do not fit together (see the module doc)."""
    run_id = _one_run(reports, run)
    members = _members(reports, run)
    newest = members[0].gen
    leases = {m.lease for m in members}
    if len(leases) > 1:
        raise TakeoverRefused(f"the members of generation {newest} were told different "
                              f"leases {sorted(map(str, leases))}: not one controller's")
    furthest = max(m.steps_done for m in members)
    steps, last_skipped = max(furthest, run.steps_done), run.last_skipped
    skip_untold = run.steps_done == furthest + 1 and run.last_skipped == furthest
    if run.steps_done > furthest and not skip_untold:
        raise TakeoverRefused(
            f"the run dir records {run.steps_done} steps committed, the furthest live member "
            f"({_furthest(members)}) applied {furthest}: the committed state is in no live "
            "worker; restore from a checkpoint")
    holders: list[str] = []
    behind: list[str] = []
    for m in members:
        holds = m.intact and m.steps_done == furthest and (
            not skip_untold or m.pending == last_skipped)
        (holders if holds else behind).append(m.name)
        if m.intact and 0 < m.steps_done < furthest - 1:
            raise TakeoverRefused(
                f"{m.name} applied {m.steps_done} steps, {_furthest(members)} {furthest}: "
                "members of a generation differ by one step at most (a collective that "
                "completed on some ranks only), unless one never received the state")
    if not holders:
        raise TakeoverRefused(f"no live member of generation {newest} holds the committed "
                              f"state of step {steps} (members: {[m.name for m in members]})")
    told = [r.lease.epoch for r in reports if r.lease is not None]
    skipped = set(run.skipped_samples).union(*(m.skipped_samples for m in members))
    return Takeover(
        run_id=run_id, lease_epoch=max([run.epoch, *told]) + 1,
        next_gen=max([run.gen, *(r.gen for r in reports)]) + 1,
        members=tuple(m.name for m in members), holders=tuple(holders),
        behind=tuple(behind),
        stale=tuple(sorted(r.name for r in reports if 0 <= r.gen < newest)),
        standby=tuple(sorted(r.name for r in reports if r.gen < 0)),
        steps_done=steps, last_skipped=last_skipped, skipped_samples=frozenset(skipped),
        unrecorded=tuple(range(run.steps_done, furthest)), ledger_steps=run.ledger_steps,
    )


def _one_run(reports: Sequence[WorkerReport], run: RunRecord) -> str:
    if run.run_id is None:
        raise TakeoverRefused("the run dir has no event log of a run (no run_start): not "
                              "the run dir of the run the workers follow")
    for r in reports:
        if r.lease is not None and r.lease.run_id != run.run_id:
            raise TakeoverRefused(f"{r.name} follows run {r.lease.run_id}, the run dir is run "
                                  f"{run.run_id}'s: a run dir from another run")
    if run.ledger_run not in (None, run.run_id, *run.earlier_runs):
        raise TakeoverRefused(f"the run dir's ledger was last written by run {run.ledger_run}, "
                              f"which its event log never started (its run: {run.run_id})")
    return run.run_id


def _members(reports: Sequence[WorkerReport], run: RunRecord) -> list[WorkerReport]:
    newest = max((r.gen for r in reports), default=-1)
    if newest < 0:
        raise TakeoverRefused("no live worker is in a generation: nothing to take over")
    if newest < run.gen:
        raise TakeoverRefused(
            f"no live worker is in generation {run.gen}, the newest the run dir names "
            f"({list(run.members)}): its members are gone; restore from a checkpoint")
    members = [r for r in reports if r.gen == newest]
    strangers = [m.name for m in members if m.name not in run.members]
    if newest == run.gen and strangers:
        raise TakeoverRefused(f"{strangers} are in generation {newest}, which the run dir "
                              f"says is {list(run.members)}")
    ranks = [m.rank for m in members if m.rank is not None]
    if len(set(ranks)) != len(ranks):
        raise TakeoverRefused(f"the members of generation {newest} do not hold distinct "
                              f"ranks: { {m.name: m.rank for m in members} }")
    # A member whose group never formed (its build failed) has no rank: it goes last.
    return sorted(members, key=lambda m: (m.rank is None, m.rank or 0, m.name))


def _furthest(members: Sequence[WorkerReport]) -> str:
    return max(members, key=lambda m: m.steps_done).name
