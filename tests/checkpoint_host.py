"""A fake of the job the checkpoint coordinator serves (planaria.checkpoint.host's Protocols),
for testing its decisions without Ray: workers are fake actors whose calls the test answers."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planaria.checkpoint.host import CheckpointHost


@dataclass
class FakeRef:
    """A call made on a fake actor: its worker, method and arguments. ``future()`` is what a
    Ray ref's is: the test sets its result (or exception) when the call should answer."""

    worker: str
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    answer: Future[Any] = field(default_factory=Future)

    def future(self) -> Future[Any]:
        return self.answer


class FakeActor:
    """``actor.<method>.remote(*args, **kwargs)`` records a :class:`FakeRef` in ``calls``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[FakeRef] = []

    def __getattr__(self, method: str) -> Any:
        actor = self

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> FakeRef:
                ref = FakeRef(actor.name, method, args, kwargs)
                actor.calls.append(ref)
                return ref

        return _Method()


@dataclass
class FakeMember:
    name: str
    actor: Any = None
    node: str | None = None
    has_state: bool = True


@dataclass(frozen=True)
class FakeLayout:
    workers_per_replica: int = 1


class FakeLog:
    """Keeps every event emitted."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, **fields}
        self.records.append(record)
        return record

    def of(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == event]


@dataclass(frozen=True)
class FakePlan:
    num_samples: int = 64
    global_batch_size: int = 8

    def describe(self) -> dict[str, int]:
        return {"num_samples": self.num_samples, "global_batch_size": self.global_batch_size,
                "seed": 0}

    def position(self, step: int) -> dict[str, int]:
        return {"epoch": 0, "index": step * self.global_batch_size}


class FakeDeadline:
    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"recent": [], "width": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


@dataclass
class FakeFaults:
    failures: int = 0
    preemptions: int = 0


class FakeHost:
    """The job, faked: ``answer(ref)`` gives each gathered call's answer (its report); the calls
    gathered are kept in ``gathered`` and the hooks called in ``hooks``."""

    def __init__(self, run_dir: Path | str, names: tuple[str, ...] = (), *,
                 nodes: tuple[str, ...] | None = None, workers_per_replica: int = 1,
                 answer: Callable[[FakeRef], Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.gen = 0
        self.members: list[FakeMember] = [
            FakeMember(n, FakeActor(n), nodes[i] if nodes else "node-0")
            for i, n in enumerate(names)]
        self.config = FakeLayout(workers_per_replica)
        self.steps_done = 0
        self.skipped_samples: set[int] = set()
        self.deadline = FakeDeadline()
        self.plan: FakePlan | None = FakePlan()
        self.ledger: object | None = None
        self.log = FakeLog()
        self.recovery = FakeFaults()
        self.answer = answer or (lambda ref: {"ok": True})
        self.gathered: list[FakeRef] = []
        self.hooks: list[tuple[str, dict[str, Any]]] = []
        self.commits = 0

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.members]

    @property
    def width(self) -> int:
        return len(self.members)

    def gather(self, refs: dict[str, Any], *, deadline_s: float, step: int | None,
               poll: Callable[[], None] | None = None) -> dict[str, Any]:
        self.gathered += refs.values()
        return {name: self.answer(ref) for name, ref in refs.items()}

    def commit_all(self) -> None:
        self.commits += 1

    def hook(self, phase: str, **info: Any) -> None:
        self.hooks.append((phase, info))

    def leave(self, name: str) -> None:
        """Worker ``name`` leaves the membership (evicted, or dead)."""
        self.members = [h for h in self.members if h.name != name]


def as_host(fake: FakeHost) -> CheckpointHost:
    """``fake`` typed as what the coordinator takes (a type checker checks it is one)."""
    return fake
