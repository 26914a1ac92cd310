"""The seams between the controller's parts: what each part may ask of another.

Each part receives only the Protocols it needs (never the whole
:class:`~planaria.control.job.Job`), so that a decision can be tested with a small fake.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from planaria.checkpoint.config import CheckpointConfig
    from planaria.control.pool import WorkerHandle

__all__ = ["Checkpoints", "Gather", "RayCheck", "Roster", "StepCount"]


class Roster(Protocol):
    """The current generation: its number and its members in rank order.

    ``members`` is read only to callers: only the membership changes it (building a
    generation, evicting). ``evict`` removes workers and fences them off (kills them with
    ``kill``) at once; a worker evicted is never waited for again.
    """

    @property
    def gen(self) -> int: ...

    @property
    def members(self) -> list[WorkerHandle]: ...

    @property
    def names(self) -> list[str]: ...

    @property
    def width(self) -> int: ...

    def with_followers(self, names: list[str]) -> list[str]: ...

    def evict(self, names: Sequence[str], *, kill: bool = True) -> None: ...


class Gather(Protocol):
    """Waits for one call per worker (``refs``: worker name -> Ray ref) and returns their
    results by name, or raises the classified :class:`~planaria.faults.errors.Failure`.

    Every wait ends: by ``deadline_s`` at the latest, sooner when a worker is judged hung
    (its heartbeat stopped, or its work made no progress past the learned deadline).
    ``step``: the step the calls run, named in a ``step_failed`` event (None: no event).
    ``poll`` is called between waits (at least every 0.25 s) while no call has failed.
    """

    def gather(self, refs: dict[str, Any], *, deadline_s: float, step: int | None,
               poll: Callable[[], None] | None = None) -> dict[str, Any]: ...


class RayCheck(Protocol):
    """Raises :class:`~planaria.faults.errors.RayLost` once Ray's GCS or this node's raylet died,
    and returns otherwise. With ``save`` (at a step boundary, every member holding the
    committed state) the step in hand is saved first; ``cause``: a failure that followed
    the loss (the RayLost is raised from it, and nothing is saved)."""

    def __call__(self, *, save: bool = False, cause: BaseException | None = None) -> None: ...


class StepCount(Protocol):
    """The committed step count (read only: the commit log alone writes it)."""

    @property
    def steps_done(self) -> int: ...


class Checkpoints(Protocol):
    """What the controller's parts ask of the checkpoint coordinator
    (:class:`~planaria.checkpoint.coordinator.Checkpointer`).

    ``save_now`` saves the step in hand and waits for its commit (its path, or None when it
    did not commit); ``save_beside`` starts a save of the step in hand beside the steps in
    flight (False when none could start); ``writers_settle`` waits for ``names``' shards of
    the save in flight; ``restore`` loads the newest viable checkpoint into every member
    and returns its step (None: none). ``due_by_time``/``next_due_step``/``maybe_save``
    are the save schedule: by the clock, by the step, and the save at a boundary.
    """

    config: CheckpointConfig

    @property
    def root(self) -> str: ...

    @property
    def last_committed(self) -> int | None: ...

    @property
    def can_save(self) -> bool: ...

    @property
    def inflight_step(self) -> int | None: ...

    def save_now(self, reason: str) -> str | None: ...

    def save_beside(self, *, reason: str) -> bool: ...

    def writers_settle(self, names: list[str], timeout_s: float) -> None: ...

    def finish_inflight(self) -> None: ...

    def restore(self, *, reason: str = "restore") -> int | None: ...

    def maybe_save(self) -> None: ...

    def due_by_time(self) -> bool: ...

    def next_due_step(self) -> int | None: ...
