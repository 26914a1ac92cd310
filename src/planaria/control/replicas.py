"""Replica checks: every replica's parameter checksum, compared (they agree unless
something is badly wrong: a silent data corruption, a bug)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planaria.data.integrity import divergent_replicas
from planaria.faults.errors import ReplicaDivergence

if TYPE_CHECKING:
    from planaria.control.commit_log import CommitLog
    from planaria.control.membership import Membership
    from planaria.control.protocols import Gather
    from planaria.observe.events import EventLog

__all__ = ["ReplicaCheck"]


class ReplicaCheck:
    """Compares a job's replicas: on demand, and every ``verify_every`` steps (None: never)."""

    def __init__(self, *, membership: Membership, calls: Gather, commit_log: CommitLog,
                 log: EventLog, verify_every: int | None) -> None:
        self.membership = membership
        self.calls = calls
        self.commit_log = commit_log
        self.log = log
        self.verify_every = verify_every
        self._verified_at = 0  # steps_done at the last comparison

    def checksums(self) -> dict[str, int]:
        """Every replica's parameter checksum (they agree unless something is badly wrong)."""
        members = self.membership
        members.commit_all()
        refs = {h.name: h.actor.checksum.remote(members.gen) for h in members.members}
        result: dict[str, int] = self.calls.gather(refs, deadline_s=60, step=None)
        return result

    def verify(self) -> None:
        """Compares every replica's parameter checksum; raises ReplicaDivergence on a mismatch.

        The replicas that differ from a strict majority are named (all of them
        when there is none); the recovery treats them as lost.
        """
        answers = self.checksums()
        sums = {h.name: answers[h.name] for h in self.membership.members}  # rank order
        steps_done = self.commit_log.steps_done
        self._verified_at = steps_done
        bad = divergent_replicas(sums)
        self.log.emit(
            "replicas_verified", step=steps_done, workers=sorted(sums), diverged=list(bad)
        )
        if bad:
            raise ReplicaDivergence(
                f"replica checksums disagree after {steps_done} steps: "
                + ", ".join(f"{n}={c:08x}" for n, c in sums.items())
                + f"; {', '.join(bad)} diverged",
                workers=bad,
                step=steps_done,
            )

    def verify_if_due(self) -> None:
        every = self.verify_every
        steps_done = self.commit_log.steps_done
        if every is None or self.membership.width < 2 or steps_done == 0 or steps_done % every:
            return
        if self._verified_at != steps_done:
            self.verify()
