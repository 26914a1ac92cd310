"""Abandoned saves: what a save that will not commit wrote is removed once none of its
writers still writes it."""

from __future__ import annotations

import time
from concurrent.futures import Executor
from typing import Any, Protocol

import ray

from planaria.checkpoint.host import Membership
from planaria.checkpoint.layout import tmp_dir_name
from planaria.checkpoint.retention import remove_uncommitted_save
from planaria.checkpoint.root import CheckpointRoot

__all__ = ["POLL_S", "AbandonedSave", "AbandonedSaves"]

POLL_S = 0.02
"""How often a wait on writers looks again (a poll answers at once while a write goes on)."""


class AbandonedSave(Protocol):
    """A save given up on: its step, id, and the writers' poll calls in flight (name ->
    the ``ckpt_poll`` ref, kept here between reaps)."""

    @property
    def step(self) -> int: ...

    @property
    def save_id(self) -> str: ...

    @property
    def polls(self) -> dict[str, Any]: ...


class AbandonedSaves:
    """Saves that will not commit whose writers may still write. ``membership.names`` are
    the workers alive now (a writer that left writes no more); removals run on ``remover``
    (behind the commits, so a commit's files are never removed under it)."""

    def __init__(self, root: CheckpointRoot, membership: Membership, remover: Executor) -> None:
        self.root = root
        self.membership = membership
        self.remover = remover
        self._saves: list[tuple[AbandonedSave, dict[str, Any]]] = []

    def __bool__(self) -> bool:
        return bool(self._saves)

    def add(self, save: AbandonedSave, pending: dict[str, Any]) -> None:
        """``save`` is abandoned; ``pending`` (name -> actor) may still write it."""
        self._saves.append((save, pending))
        self.reap()

    def reap(self) -> None:
        """Removes an abandoned save's files once none of its writers still writes them (its
        temporary directory on local disk, its prefix under the step on object stores)."""
        keep = []
        for save, pending in self._saves:
            live = set(self.membership.names)
            for name in [n for n in pending if n not in live]:
                del pending[name]
            for name, actor in list(pending.items()):
                ref = save.polls.get(name) or actor.ckpt_poll.remote(save.save_id)
                save.polls[name] = ref
                done, _ = ray.wait([ref], timeout=0)
                if done:
                    del save.polls[name]
                    try:
                        if ray.get(done[0]) is None:
                            continue  # still writing
                    except Exception:  # it failed or died: it writes no more
                        pass
                    del pending[name]
            if pending:
                keep.append((save, pending))
            elif self.root.local:
                st = self.root.storage()
                tmp = st.path(tmp_dir_name(save.step, save.save_id))
                self.remover.submit(st.remove_tree, tmp)
            else:
                self.remover.submit(remove_uncommitted_save, self.root.storage(),
                                    save.step, save.save_id)
        self._saves = keep

    def wait(self, timeout_s: float) -> None:
        """Waits (bounded, here rather than in a worker's actor call) until no writer of an
        abandoned save still writes: a new snapshot would find its writer busy."""
        end = time.monotonic() + timeout_s
        self.reap()
        while self._saves and time.monotonic() < end:
            refs = [save.polls[n] for save, pending in self._saves for n in pending
                    if n in save.polls]
            if refs:
                ray.wait(refs, num_returns=1, timeout=min(0.5, max(0.0, end - time.monotonic())))
            time.sleep(POLL_S)  # a poll answers at once while the write goes on
            self.reap()
