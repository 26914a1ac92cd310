"""A worker's place in the job: its generation, its group, the fence and the abort.

Every call from the controller carries the generation; an older one is refused
(invariant 3). A worker the controller evicted finds its fence key and exits (a
zombie that woke up never touches the job). The controller's ``abort`` tells a
survivor that a peer of its generation failed: the step in progress is abandoned
between micro-batches and a collective in flight is interrupted.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from planaria.faults.errors import StaleGeneration, StepAborted
from planaria.wire import store_keys
from planaria.wire.takeover import Lease
from planaria.worker.collective import Collective

__all__ = ["Membership"]

_log = logging.getLogger("planaria.worker")


class Membership:
    """The generation this worker is in and its process group for it."""

    def __init__(self, name: str, store: Any, *, sharded: bool) -> None:
        """``sharded``: the worker is one of a replica of several (planaria.worker.sharded)."""
        self.name = name
        self.store = store
        self.sharded = sharded
        self.gen = -1
        self.comm: Collective | None = None
        self.aborted_gen = -1  # the last generation the controller told to abort
        self.lease: Lease | None = None  # the newest controller's, told at a join

    def refuse_if_fenced(self) -> None:
        """A call queued before this worker was evicted finds the fence and ends the process."""
        if self.store.check([store_keys.fence(self.name)]):
            _log.warning("%s was fenced off by the controller; exiting", self.name)
            os._exit(0)

    def enter(self, gen: int, *, lease: Lease | None = None) -> None:
        """A call that may start generation ``gen`` (join, settle_run): not an older one,
        nor one from a controller under an older ``lease`` epoch than the newest told (a
        controller that was taken over)."""
        self.refuse_if_fenced()
        if lease is not None and self.lease is not None and lease.epoch < self.lease.epoch:
            raise StaleGeneration(
                f"{self.name} follows lease epoch {self.lease.epoch}, refused a join from "
                f"epoch {lease.epoch}: that controller was taken over"
            )
        if gen < self.gen:
            raise StaleGeneration(
                f"{self.name} is in generation {self.gen}, refused call from {gen}"
            )
        self.gen = gen
        if lease is not None:
            self.lease = lease

    def check(self, gen: int) -> None:
        """A call of generation ``gen``, which must be this worker's."""
        self.refuse_if_fenced()
        if gen != self.gen:
            raise StaleGeneration(
                f"{self.name} is in generation {self.gen}, refused a call from generation {gen}"
            )

    def join(self, gen: int, rank: int, world_size: int, *, backend: str,
             timeouts: tuple[float, float], shard_index: int) -> Collective:
        """Drops the old group and builds generation ``gen``'s."""
        self.close()
        self.comm = Collective(
            self.store,
            gen,
            rank,
            world_size,
            backend=backend,
            join_timeout_s=timeouts[0],
            timeout_s=timeouts[1],
            tag=f"s{shard_index}/" if shard_index else "",  # shard index's group
        )
        return self.comm

    def abort(self, gen: int) -> None:
        """A peer of generation ``gen`` failed: interrupt a collective of that generation,
        and let the step in progress see it (:meth:`raise_if_aborted`)."""
        comm = self.comm
        if comm is not None and comm.gen <= gen:
            comm.interrupt()
        self.aborted_gen = max(self.aborted_gen, gen)

    @property
    def aborted(self) -> bool:
        """The controller aborted this worker's generation."""
        return self.aborted_gen >= self.gen

    def raise_if_aborted(self, step: int) -> None:
        """Called between micro-batches: a peer failed during this step (see :meth:`abort`).

        Not in a sharded replica: its workers would see the flag at different micro-batches
        and leave one another waiting in FSDP's collectives; they go on to the reduction,
        which fails on all of them alike (planaria.worker.sharded)."""
        comm = self.comm
        if comm is None or comm.world_size == 1 or self.sharded:
            return
        if self.aborted_gen >= self.gen:
            raise StepAborted(f"{self.name} abandoned step {step}: a peer failed")

    def abort_generation(self, step: int) -> None:
        """This worker's step ``step`` failed: its peers abandon theirs (the abort key) and
        none waits on this rank in a collective (the group closes)."""
        with contextlib.suppress(Exception):
            self.store.set(store_keys.abort(self.gen), str(step))
        if self.comm is not None:
            self.comm.close()

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
            self.comm = None
