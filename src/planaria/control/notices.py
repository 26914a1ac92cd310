"""Preemption notices: read while steps run, acted on at the step boundary.

A worker's notice (SIGTERM, or its node drained by Ray) puts it in
:attr:`Departures.draining <planaria.control.departures.Departures.draining>`: it
leaves at the next boundary (:meth:`Recovery.drain <planaria.control.recovery.Recovery.drain>`).
When every member that holds the state got one (a spot-reclaim wave), the state is
saved at once, beside the steps, and they leave together once it is written
(:meth:`Recovery.evacuate <planaria.control.recovery.Recovery.evacuate>`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from planaria.faults import points
from planaria.wire import store_keys

if TYPE_CHECKING:
    from planaria.control.departures import Departures, FaultTimes
    from planaria.control.pool import WorkerPool
    from planaria.control.protocols import Checkpoints, Roster, StepCount
    from planaria.observe.events import EventLog

__all__ = ["Notices"]

_log = logging.getLogger("planaria.commits")


class Notices:
    """Reads a job's preemption notices into its :class:`Departures`.

    ``draining_nodes``: the nodes Ray drains (node id -> deadline in ms, 0 if none), as
    the drain watch last saw them (None: not watched). ``abort_generation`` ends the
    calls in flight (the members leave at the step in hand).
    """

    def __init__(
        self, *, store: Any, roster: Roster, departures: Departures, fault_times: FaultTimes,
        log: EventLog, steps: StepCount, checkpoints: Checkpoints | None, pool: WorkerPool,
        draining_nodes: Callable[[], dict[str, int]] | None,
        abort_generation: Callable[[], None],
    ) -> None:
        self.store = store
        self.roster = roster
        self.departures = departures
        self.fault_times = fault_times
        self.log = log
        self.steps = steps
        self.checkpoints = checkpoints
        self.pool = pool
        self.draining_nodes = draining_nodes
        self.abort_generation = abort_generation
        self._notices_seen = 0  # the store's notice counter, as last read

    def poll(self) -> None:
        """Preemption notices that came while steps run (one store read of a counter the
        workers bump, see planaria.control.liveness.beat). When every member that holds the state
        got one, the state is saved at once and the generation is aborted (see the
        module doc)."""
        try:
            count = int(self.store.add(store_keys.NOTICES, 0))
        except Exception:  # the store is ours; the next poll reads it again
            return
        if count <= self._notices_seen:
            return
        self._notices_seen = count
        draining = self.departures.draining
        for handle in self.roster.members:
            if handle.name in draining:
                continue
            # A sharded replica's other workers' notices are the replica's.
            for name in self.roster.with_followers([handle.name]):
                if self.store.check([store_keys.notice(name)]):
                    draining.add(handle.name)
                    at = float(self.store.get(store_keys.notice(name)).decode() or time.time())
                    self.fault_times.caused.setdefault(handle.name, at)  # dated by its notice
                    self.log.emit("preempt_notice", worker=handle.name,
                                  step=self.steps.steps_done, source="sigterm", notice_t=at)
                    break
        # Joiners still receiving the state beside the step hold none yet: the save runs
        # anyway (the notices' deadline is not known here, and a receipt can fail).
        holders = {h.name for h in self.roster.members if h.has_state}
        if holders and holders <= draining and not self.departures.evacuating:
            self._save_before_leaving()

    def _save_before_leaving(self) -> None:
        names = tuple(sorted(self.departures.draining & set(self.roster.names)))
        ck = self.checkpoints
        if ck is None or not ck.can_save or not ck.config.save_on_preemption:
            self.log.emit("preemption_unsaved", workers=list(names),
                          reason="every replica holding the state got a notice and checkpoints "
                          "are off: the last one stays until a replacement took the state")
            return
        _log.warning("every replica got a preemption notice (%s): saving the state before "
                     "they leave", ", ".join(names))
        if ck.save_beside(reason="preemption"):
            self.departures.evacuating = names
            self.departures.leave_now = True  # the wait in flight ends in a Preempted
            self.abort_generation()  # the held steps are dropped: they leave at step in hand

    def reported(self, name: str, preempting: bool, step: int) -> None:
        """A run's result says ``name`` is ``preempting`` (it got SIGTERM) at ``step``."""
        if preempting and name not in self.departures.draining:
            self.departures.draining.add(name)
            self.log.emit("preempt_notice", worker=name, step=step, source="sigterm")

    def notice_draining_nodes(self) -> None:
        """The members on nodes Ray drains get their notice now (as if each had got SIGTERM);
        standby spares there are let go. Reads the watch's last answer: no query here."""
        if self.draining_nodes is None:
            return
        nodes = self.draining_nodes()
        if not nodes:
            return
        draining = self.departures.draining
        for handle in self.roster.members:
            node = handle.ray_node
            if node in nodes and handle.name not in draining:
                draining.add(handle.name)
                deadline = nodes[node] / 1000 if nodes[node] else None
                self.log.emit(
                    "preempt_notice", worker=handle.name, step=self.steps.steps_done,
                    source="node_drain", node=node, deadline_t=deadline,
                )
        self.pool.drop_spares_on(set(nodes))

    def stay_for_receivers(self, names: list[str], holders: list[str],
                           receiving: bool) -> list[str]:
        """Those of ``names`` (members with a notice) that may leave at this boundary: while
        joiners still receive the state beside their first step (``receiving``) and every
        holder of it is among ``names``, the holders stay, marked to leave at a later
        boundary (once it has arrived, they are holders no more alone)."""
        if not receiving or not set(holders) <= set(names):
            return names
        _log.info("%s stay until the joiners hold the state", ", ".join(holders))
        for name in holders:
            self.keep_draining(name)
        points.hit("notices.holders_stay", holders=holders)
        return [n for n in names if n not in holders]

    def keep_draining(self, name: str) -> None:
        """``name`` got a preemption notice but stays until a later boundary (see drain)."""
        self.departures.draining.add(name)

    def take_draining(self) -> list[str]:
        """The members to drain at this boundary (sorted); none is left marked."""
        draining = sorted(self.departures.draining)
        self.departures.draining.clear()
        return draining
