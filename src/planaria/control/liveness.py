"""Is a worker alive, and is it making progress? Judged on the controller's clock alone.

Busy is not hung. Two separate signals come from each worker's heartbeat record
in the controller's store (``hb/<name>``, written by a thread in the worker):

- **liveness**: the record carries a counter that the heartbeat thread bumps at
  every beat, so it changes every ``heartbeat_s`` while the process runs. A
  record that has not changed for ``heartbeat_timeout_s`` (measured here, since
  the controller last saw it change: no two hosts' clocks are ever compared)
  means a stopped or frozen process.
- **progress**: the record also carries the worker's phase and a progress
  counter that its main thread bumps at every micro-batch and phase change. A
  worker in a phase of its own work (loading, computing, applying) whose
  progress counter has not moved for longer than the step deadline learned at
  the current width is stuck (a deadlock, a hung kernel) though its heartbeat
  thread still runs. A worker waiting on its peers (in a collective, a
  rendezvous, a state transfer) is never judged by progress: it waits for
  someone else, and that someone is the one to judge.
- **busy**: the record also counts the beats at which the worker's working threads
  were doing something (:class:`planaria.worker.busy.BusyProbe`: CPU time, frames), so a
  heavy micro-batch or a slow ``dataset[i]`` that computes is progress too, though no
  micro-batch finished: busy is not hung.
- **work**: the record names what the worker is on (``m<j>``: micro-batch j of its
  step; ``i<id>``: loading sample id), so a deadline can depend on the work: loading
  is judged by the I/O deadline (a slow load is not a hang), and a deadline that
  killed one worker on a piece of work is doubled before the next is judged on it
  (the controller's ``deadline_for``).
- **I/O**: a worker reading a checkpoint or moving state to a joiner bumps its
  progress at every chunk. Past the read's deadline (which grows with the bytes) it
  is hung only if its bytes stopped moving: a slow read that moves is never killed.
- **learned timeout**: a worker's heartbeat thread measures the longest gap between
  its own beats (a GC pause, swap, a noisy neighbour stall the whole process) and
  reports it; the heartbeat timeout in force is the configured one or a multiple of
  the longest gap a live worker has shown, whichever is longer, so that a process
  that is healthy but pauses is not taken for a stopped one.

A peer's death never makes the survivors suspects: the controller tells them
(:meth:`Worker.abort <planaria.worker.Worker.abort>`, a call that runs beside the
step), they abandon the step between micro-batches and answer.

- **vouched**: while a run of steps commits (rank 0's stream brings new steps,
  each reduced by every rank of the run), every rank is alive and moving, so the
  controller reads no heartbeat (reading N records is O(N)): :meth:`Liveness.vouch`.
  When the steps stop coming for :meth:`Liveness.vouch_s`, it reads them again,
  and a record that changed while it was not looking is dated at the last vouch
  (or ``vouch_s`` ago, if later): a hang is found about as soon as if it had
  looked all along, and a live worker is never found silent.

The worker's side is :func:`planaria.wire.heartbeat.beat`: one store write per beat, a
look at its fence about once a second. **Progress is the heartbeat**: while the worker's
autonomous run commits steps (one within :data:`~planaria.wire.heartbeat.QUIET_S`), it
skips the write, since the steps on rank 0's stream say more than a beat would; the
controller counts a vouch as a sighting of every rank it names, so a record that did not
change while the steps came is silent only since the last vouch. At width N that takes N
writes per beat off the controller's store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from planaria.control.clock import REAL_CLOCK, Clock
from planaria.wire import store_keys
from planaria.wire.heartbeat import Heartbeat

__all__ = ["IO_PHASES", "IO_STALL_S", "PEER_PHASES", "WORK_PHASES", "Liveness"]

_log = logging.getLogger("planaria.control.liveness")

WORK_PHASES = frozenset({"loading", "compute", "apply"})
"""Phases in which a worker does its own work, so that no progress means stuck."""
IO_PHASES = frozenset({"ckpt_read", "send_state", "recv_state"})
"""Phases in which a worker moves bytes (a checkpoint read, a state transfer), bumping its
progress at every chunk."""
PEER_PHASES = frozenset({"reduce", "joining", "send_state", "recv_state", "ckpt_bcast", "held"})
"""Phases in which a worker waits on its peers: not judged by its own progress (see
:meth:`Liveness.all_waiting`)."""
GAP_FACTOR = 3.0
"""The heartbeat timeout in force is at least this many times the longest beat gap a live
worker reported."""
GAP_CEILING_S = 120.0
"""... but a learned timeout never exceeds this."""
GAP_MEMORY_S = 60.0
"""A worker's reported gap counts while its record was read this recently (an evicted
worker's does not)."""
IO_STALL_S = 30.0
"""Past its deadline, a read whose bytes moved within this many seconds is still waited for."""
@dataclass
class _Seen:
    record: Heartbeat
    changed_t: float  # controller's monotonic clock: when the record last changed
    progress_t: float  # ... when the progress counter, the phase or the busy count changed
    observed_t: float  # ... when it was last read
    step_t: float = 0.0  # ... when the progress counter or the phase changed (busy aside)


class Liveness:
    """The controller's view of every worker's heartbeat, on ``clock``'s monotonic time; its
    wall-clock time dates what it reports (:meth:`last_alive_t`). ``base_timeout_s``: the
    configured heartbeat timeout (a test may change it while the job runs)."""

    def __init__(self, store: dist.Store, *, timeout_s: float, clock: Clock = REAL_CLOCK) -> None:
        self.store = store
        self.base_timeout_s = timeout_s
        self._clock = clock.monotonic
        self._wall_clock = clock.now
        self._seen: dict[str, _Seen] = {}
        self._vouched: frozenset[str] = frozenset()
        self._vouch_t = -float("inf")

    @property
    def timeout_s(self) -> float:
        """The heartbeat timeout in force: the configured one, or :data:`GAP_FACTOR` times
        the longest beat gap a worker still watched has reported (up to
        :data:`GAP_CEILING_S`), whichever is longer."""
        now = self._clock()
        gaps = [seen.record.gap_ms for seen in self._seen.values()
                if now - seen.observed_t <= GAP_MEMORY_S]  # workers still watched
        learned = min(GAP_CEILING_S, GAP_FACTOR * max(gaps, default=0) / 1000)
        return max(self.base_timeout_s, learned)

    @property
    def vouch_s(self) -> float:
        """How long a vouch stands: well inside the heartbeat timeout."""
        return min(1.0, self.base_timeout_s / 3)

    def vouch(self, names: frozenset[str]) -> None:
        """``names`` (a run's ranks) just committed a step together: all alive and moving.
        O(1): pass the same frozenset for the whole run."""
        self._vouched, self._vouch_t = names, self._clock()

    def vouched_recently(self) -> bool:
        """A vouch stands: reading the heartbeats can wait."""
        return self._clock() - self._vouch_t <= self.vouch_s

    def observe(self, names: list[str]) -> None:
        """Reads the heartbeats of ``names`` (one store round trip) and notes what changed."""
        if not names:
            return
        keys = [store_keys.heartbeat(n) for n in names]
        try:  # multi_get would wait for a missing key: check first (one round trip when all are)
            if self.store.check(keys):
                present = list(names)
            else:
                present = [n for n, k in zip(names, keys, strict=True) if self.store.check([k])]
            raws = (self.store.multi_get([store_keys.heartbeat(n) for n in present])
                    if present else [])
        except Exception:  # the store itself is the controller's: a read error is transient
            return
        now = self._clock()
        for name, raw in zip(present, raws, strict=True):
            try:
                record = Heartbeat.parse(raw)
            except ValueError:
                continue
            seen = self._seen.get(name)
            if seen is None:
                self._seen[name] = _Seen(record, now, now, now, now)
                continue
            if name in self._vouched and seen.observed_t < self._vouch_t:
                # The vouch was a sighting: alive and moving then, whatever the record says
                # (a worker whose run commits skips its beats, see beat).
                seen.changed_t = max(seen.changed_t, self._vouch_t)
                seen.progress_t = max(seen.progress_t, self._vouch_t)
                seen.step_t = max(seen.step_t, self._vouch_t)
            if record != seen.record:
                stepped = (record.progress, record.phase) != (seen.record.progress,
                                                              seen.record.phase)
                moved = stepped or record.busy != seen.record.busy
                # Not read while a vouch stood: it changed by the vouch, maybe not since. Dated
                # no earlier than vouch_s ago (well inside the timeout): a read long after
                # the vouch (the next generation's) must not find a live worker silent.
                at = now
                if name in self._vouched and seen.observed_t < self._vouch_t:
                    at = max(self._vouch_t, now - self.vouch_s)
                frozen = seen.observed_t - seen.changed_t
                if frozen > self.vouch_s:
                    # Read unchanged for a while, its heartbeat silent: the whole process was
                    # paused (a GC, swap, SIGSTOP, a VM freeze), which the heartbeat timeout
                    # judges. That time is not its work's: its deadline runs from where it
                    # stood.
                    seen.progress_t = min(at, seen.progress_t + frozen)
                    seen.step_t = min(at, seen.step_t + frozen)
                seen.record, seen.changed_t = record, at
                if moved:
                    seen.progress_t = at
                if stepped:
                    seen.step_t = at
            seen.observed_t = now

    def watch(self, names: list[str]) -> None:
        """A call was just sent to ``names``: their progress clocks start now (a worker that
        sat idle in a work phase's label since its last call is not stuck)."""
        self.observe(names)
        now = self._clock()
        for name in names:
            seen = self._seen.get(name)
            if seen is not None:
                seen.progress_t = seen.step_t = now

    def last(self, name: str) -> Heartbeat | None:
        seen = self._seen.get(name)
        return None if seen is None else seen.record

    def silent_s(self, name: str) -> float:
        """Seconds since the heartbeat last changed (0 if never seen)."""
        seen = self._seen.get(name)
        return 0.0 if seen is None else self._clock() - seen.changed_t

    def stopped(self, name: str) -> bool:
        """The heartbeat thread stopped: the process is stopped, frozen or gone."""
        return self.silent_s(name) > self.timeout_s

    def stuck(self, name: str, deadline_s: float | Callable[[Heartbeat], float]) -> bool:
        """In a phase of its own work with no progress (nor busy beat) for longer than
        ``deadline_s`` (seconds, or a function of the worker's record: its work's deadline)."""
        seen = self._seen.get(name)
        if seen is None or seen.record.phase not in WORK_PHASES:
            return False
        if self.silent_s(name) > self.vouch_s:
            # Its heartbeat is silent too: the whole process is frozen or paused (a GC, swap,
            # SIGSTOP), which the heartbeat timeout judges, not the step's deadline.
            return False
        limit = deadline_s(seen.record) if callable(deadline_s) else deadline_s
        return self._clock() - seen.progress_t > limit

    def still_s(self, name: str) -> float:
        """Seconds since the worker's progress (or busy count, or phase) last moved."""
        seen = self._seen.get(name)
        return 0.0 if seen is None else self._clock() - seen.progress_t

    def all_waiting(self, names: list[str], for_s: float,
                    phases: frozenset[str] = PEER_PHASES) -> bool:
        """Every one of ``names`` has waited on its peers (in one of ``phases``: a
        collective, a rendezvous, a transfer) with no progress for longer than ``for_s``:
        some rank cannot be reached. Reads nothing: call after :meth:`observe`."""
        if not names:
            return False
        for name in names:
            seen = self._seen.get(name)
            if seen is None or seen.record.phase not in phases:
                return False
            if self._clock() - seen.step_t <= for_s:  # a thread spinning in a wait is no step
                return False
            if self.silent_s(name) > self.vouch_s:
                return False  # frozen or paused as a whole: the heartbeat timeout judges it
        return True

    def last_progress_t(self, name: str, *, steps_only: bool = False) -> float | None:
        """Wall-clock estimate of when ``name`` last made progress (its own record's view:
        when a stuck worker stopped; with ``steps_only``, its progress counter or phase
        alone, not its busy beats: when a cut-off worker's waiting began; for fault
        timing)."""
        seen = self._seen.get(name)
        if seen is None:
            return None
        at = seen.step_t if steps_only else seen.progress_t
        if name in self._vouched:
            at = max(at, self._vouch_t)
        return self._wall_clock() - (self._clock() - at)

    def moving(self, name: str, within_s: float) -> bool:
        """In an I/O phase with progress in the last ``within_s`` seconds."""
        seen = self._seen.get(name)
        if seen is None or seen.record.phase not in IO_PHASES:
            return False
        return self._clock() - seen.progress_t <= within_s

    def hung(
        self, names: list[str], deadline_s: float | Callable[[Heartbeat], float]
    ) -> list[str]:
        """Of ``names``, those whose heartbeat stopped or that are stuck in their own work."""
        self.observe(names)
        return [n for n in names if self.stopped(n) or self.stuck(n, deadline_s)]

    def last_alive_t(self, name: str) -> float | None:
        """Wall-clock estimate of when ``name`` was last seen alive (for fault timing)."""
        seen = self._seen.get(name)
        if seen is None:
            return None
        at = seen.changed_t
        if name in self._vouched:  # a vouch is a sighting (it was not read meanwhile)
            at = max(at, self._vouch_t)
        return self._wall_clock() - (self._clock() - at)

    def forget(self, name: str) -> None:
        self._seen.pop(name, None)
