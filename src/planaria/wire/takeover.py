"""What a controller taking over live workers learns from them: the lease they follow and
each one's report of itself (:meth:`Worker.describe <planaria.worker.actor.Worker.describe>`).

A controller's *lease* is its run and its epoch. Every join carries it; a worker records
the newest it was told and refuses a join under an older epoch, so that a controller
that comes back after dying (a new epoch, greater than any seen) fences off the one
it replaces. :mod:`planaria.control.takeover` rebuilds the controller's state from the
reports and the run dir.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Lease", "WorkerReport"]


@dataclass(frozen=True, kw_only=True)
class Lease:
    """The controller a worker follows: a run, and the epoch of the controller that drives it
    (1 for the run's first controller, one more at each takeover)."""

    run_id: str
    epoch: int


@dataclass(frozen=True, kw_only=True)
class WorkerReport:
    """A replica as its worker describes itself (a sharded replica: merged, see
    :meth:`merged`). Read without the step's lock: a snapshot, exact when no step runs."""

    name: str
    """The replica's name (its leader's, ``w<N>``)."""
    workers: int
    """The workers the report covers (the replica's shards)."""
    gen: int
    """The generation it last entered (-1: it never joined one, a standby spare)."""
    rank: int | None
    """Its rank in that generation (None: no group)."""
    steps_done: int
    """Steps applied to its state."""
    pending: int | None
    """A step computed and not yet applied or dropped (its next join settles it)."""
    intact: bool
    """Its state is whole: no restore left it part-written."""
    lease: Lease | None
    """The newest lease it was told (None: never joined)."""
    skipped_samples: tuple[int, ...] = ()
    """The samples it was told the job skips (sorted)."""

    def merged(self, others: Sequence[WorkerReport]) -> WorkerReport:
        """A sharded replica's report from its leader's (``self``) and its other workers':
        the replica is as far as its least advanced worker, whole only if every shard is,
        in a generation only if every worker entered it, under the oldest lease told."""
        parts = [self, *others]
        pending = {p.pending for p in parts}
        leases = [p.lease for p in parts]
        return WorkerReport(
            name=self.name, workers=sum(p.workers for p in parts),
            gen=min(p.gen for p in parts), rank=self.rank,
            steps_done=min(p.steps_done for p in parts),
            pending=self.pending if len(pending) == 1 else None,
            intact=all(p.intact for p in parts),
            lease=None if any(lease is None for lease in leases)
            else min((lease for lease in leases if lease is not None),
                     key=lambda lease: lease.epoch),
            skipped_samples=self.skipped_samples,
        )
