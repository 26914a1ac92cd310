"""Replacements for lost workers: asked of the pool at once, or owed until the step after.

A lost worker's replacement is a cold start of seconds. Asked for between the survivors'
new generation and their resumed step, it put its start on the recovery's critical path:
~2 ms of the controller's time, and the CPU its forked process took from the survivors
(medium model, 3 replicas, 2 cores: kill → back 62-78 ms with it there, 52-65 ms without).
So a recovery that does not wait for it *owes* it, and the owed starts go out once the
resumed step has committed, or when the next failure comes, whichever is first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planaria.control.pool import WorkerPool

__all__ = ["Replacements"]


class Replacements:
    """Starts replacements in ``pool`` for lost workers, unless ``enabled`` is False
    (``RecoveryPolicy.replace_workers``)."""

    def __init__(self, pool: WorkerPool, *, enabled: bool) -> None:
        self.pool = pool
        self.enabled = enabled
        self.owed: list[str] = []

    def start(self, names: Sequence[str]) -> None:
        """Replacements for ``names``, asked for now."""
        if not self.enabled:
            return
        for name in names:
            self.pool.start(replaces=name)

    def owe(self, names: Sequence[str]) -> None:
        """Replacements for ``names``, asked for at :meth:`start_owed`."""
        self.owed += [n for n in names if n not in self.owed]

    def start_owed(self) -> None:
        """The owed replacements, asked for now (after a commit, or at the next failure)."""
        owed, self.owed = self.owed, []
        self.start(owed)

    @property
    def coming(self) -> bool:
        """A replacement is starting in the pool."""
        return self.pool.pending_count > 0
