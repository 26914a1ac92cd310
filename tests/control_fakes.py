"""Small typed fakes of the controller's seams (planaria.control.protocols), to test one
part's decisions without Ray."""

from __future__ import annotations

from collections.abc import Sequence

from planaria.control.pool import WorkerHandle
from planaria.wire.state_reports import Setup


def handle(name: str, *, node: str | None = None, has_state: bool = True) -> WorkerHandle:
    """A member as the controller sees it (no actor behind it), set up on Ray node ``node``."""
    info = Setup(pid=0, node="host", ray_node=node, init_t=0.0, start={}, checksum=0,
                 param_bytes=0, num_samples=0, data_fingerprint={}, dataset_draws=())
    return WorkerHandle(name=name, actor=None, requested_t=0.0, info=info, has_state=has_state)


class FakeRoster:
    """A generation of members (planaria.control.protocols.Roster)."""

    def __init__(self, members: Sequence[WorkerHandle], *, gen: int = 0) -> None:
        self.members = list(members)
        self.gen = gen
        self.evicted: list[str] = []

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.members]

    @property
    def width(self) -> int:
        return len(self.members)

    def with_followers(self, names: list[str]) -> list[str]:
        return names

    def evict(self, names: Sequence[str], *, kill: bool = True) -> None:
        self.evicted += [n for n in names if n in self.names]
        self.members = [h for h in self.members if h.name not in names]


class FakeSchedule:
    """The save schedule of planaria.control.protocols.Checkpoints: a save due at a step
    and/or by the clock (the rest of the protocol is not asked for by the planner)."""

    def __init__(self, *, due_step: int | None = None, due_by_time: bool = False) -> None:
        self.due_step = due_step
        self.by_time = due_by_time

    def next_due_step(self) -> int | None:
        return self.due_step

    def due_by_time(self) -> bool:
        return self.by_time
