"""Worker calls, started elsewhere, waited on and judged here.

:class:`Calls` waits for one call per worker and turns what went wrong into one
classified :class:`~planaria.faults.errors.Failure`. Busy is not hung: a worker is hung
only if its heartbeat stops or its own work makes no progress past the learned
deadline (:class:`~planaria.control.liveness.Liveness`); a hang is attributed to the work
or to the worker (:mod:`planaria.control.attribution`); ranks cut off from their peers are
found by probing the links (:mod:`planaria.control.links`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from planaria.control.attribution import Attribution, Blame, Sighting
from planaria.control.call_watch import CallWatch, Exits
from planaria.control.clock import REAL_CLOCK, Clock
from planaria.control.departures import Departures, FaultTimes
from planaria.control.liveness import IO_STALL_S, WORK_PHASES, Liveness
from planaria.faults import points
from planaria.faults.errors import (
    Failure,
    PeerFailed,
    Preempted,
    Work,
    WorkerExited,
    WorkerLost,
    WorkerUnreachable,
    WorkFault,
    classify,
    is_death,
)
from planaria.wire import store_keys
from planaria.wire.heartbeat import Heartbeat
from planaria.wire.reports import RunFailed

if TYPE_CHECKING:
    from planaria.control.policy import HangConfig
    from planaria.control.pool import WorkerPool
    from planaria.control.protocols import Roster
    from planaria.control.watchdog import StepDeadline
    from planaria.observe.events import EventLog

__all__ = ["Calls", "leaders", "work_of"]

_log = logging.getLogger("planaria.commits")

CONFIRM_S = 1.0
"""How long a failure's classification waits to learn whether a worker that answered with
an error beside a peer's death is alive (see Calls._confirm_survivors)."""
LINK_GRACE_S = 1.0
"""Every rank of a run waiting on its peers this long past the step deadline is looked into:
some rank cannot be reached (planaria.control.links)."""


class Calls:
    """Waits on and judges the calls to one job's workers (see the module doc).

    ``roster``: the generation the calls go to; ``departures``: workers leaving on a
    notice (a wait ends in a Preempted when they must leave together); ``fault_times``:
    where a hang found here dates its fault from; ``clock``: what its waits' timing reads;
    ``exits``: the workers' lifelines (a death ends its call before Ray's notice; None:
    Ray's notice alone).
    """

    def __init__(
        self, *, roster: Roster, store: Any, liveness: Liveness, deadline: StepDeadline,
        hang: HangConfig, attribution: Attribution, pool: WorkerPool, log: EventLog,
        departures: Departures, fault_times: FaultTimes, clock: Clock = REAL_CLOCK,
        exits: Exits | None = None,
    ) -> None:
        self.clock = clock
        self.exits = exits
        self.roster = roster
        self.store = store
        self.liveness = liveness
        self.deadline = deadline
        self.hang = hang
        self.attribution = attribution
        self.pool = pool
        self.log = log
        self.departures = departures
        self.fault_times = fault_times
        self._aborted_gen = -1  # the last generation told to abort (once each)

    def gather(
        self, refs: dict[str, Any], *, deadline_s: float, step: int | None,
        poll: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Waits for one call per worker; raises the classified Failure if any went wrong.

        Every wait has a deadline, but busy is not hung: while waiting, a worker is
        hung only if its heartbeat stops or it makes no progress in its own work past
        the learned deadline (:class:`~planaria.control.liveness.Liveness`). From the first
        error on, the generation is aborted (``abort/<gen>``): the others abandon the
        call between micro-batches and answer, so the wait ends in about one
        micro-batch. Past ``deadline_s`` (the last resort), the workers not waiting
        on a peer are hung, or all of them if every one is. ``poll`` is called
        between waits (at least every 0.25 s) while no call has failed.

        Calls end by Ray's notices (:class:`~planaria.control.call_watch.CallWatch`); when none
        has come for ``hang.recheck_s``, Ray is asked directly, so a lost notice costs
        seconds. A worker evicted as hung is not waited for: it was killed. A wait past
        the step deadline logs, every ``hang.wait_report_s``, whom it waits for and what
        they are doing (fault point ``calls.wait_reported``).
        """
        by_ref = {ref: name for name, ref in refs.items()}
        results: dict[str, Any] = {}
        errors: dict[str, BaseException] = {}
        hung: list[str] = []
        work_hung: dict[str, tuple[Work | None, str]] = {}  # hangs the work is to blame for
        clock = self.clock
        end = clock.monotonic() + deadline_s
        # A wait costs O(1) in the number of calls; a death ends its call at once (lifelines).
        calls = CallWatch(by_ref, exits=self.exits)
        self.liveness.watch(self.roster.with_followers(list(refs)))
        unreachable: list[str] = []  # ranks cut off from their peers (planaria.control.links)
        began = last_end = last_report = clock.monotonic()
        next_link_check = began
        while len(calls):
            now = clock.monotonic()
            if now >= end:
                late = self._past_deadline([by_ref[r] for r in calls.pending])
                if late:
                    hung += late
                    break
                end = now + 1.0  # every one of them still moves checkpoint bytes
            ended = calls.wait(min(0.25, end - now))
            if not ended and clock.monotonic() - last_end >= self.hang.recheck_s:
                ended = calls.recheck()  # a second source: Ray's callback may not have come
                if ended:
                    _log.warning("the calls to %s had ended without Ray's notice; found by "
                                 "asking", ", ".join(by_ref[r] for r in ended))
                last_end = clock.monotonic()  # asked: the next ask is recheck_s away
            if ended:
                last_end = clock.monotonic()
            for ref in ended:
                name = by_ref[ref]
                try:
                    result = calls.result(ref)
                    if isinstance(result, RunFailed):  # a peer's failure ended its run
                        raise PeerFailed(result.error, settled=result.settled)
                    results[name] = result
                except Exception as err:
                    errors[name] = err
                    if is_death(err):  # known now; classified once the others answered
                        self.log.emit("failure_seen", worker=name, how="death",
                                      via="lifeline" if isinstance(err, WorkerExited) else "ray")
                    self.abort_generation()
            if not len(calls):
                break
            if poll is not None and not errors:
                poll()
                if self.liveness.vouched_recently():
                    continue  # steps commit: every rank of the run is alive and moving
            now = clock.monotonic()
            if (now - last_report >= self.hang.wait_report_s
                    and now - began >= self.deadline.seconds):
                last_report = now  # longer than a step should take: say what holds it
                self._report_wait([by_ref[r] for r in calls.pending], step, now - began)
            pending = [by_ref[r] for r in calls.pending]
            found = self.liveness.hung(self.roster.with_followers(pending), self._deadline_for)
            # In a sharded replica, workers wait inside FSDP's collectives (in phase compute)
            # on one that is frozen (judged by the heartbeat timeout) or busy: only a replica
            # none of whose workers moves is stuck.
            found = [n for n in found if self.liveness.stopped(n) or not self._peer_moves(n)]
            for name in found:  # a replica's other worker: dated from its own record
                if "." in name:
                    seen = (self.liveness.last_alive_t(name) if self.liveness.stopped(name)
                            else self.liveness.last_progress_t(name))
                    self.fault_times.stuck_since.setdefault(name.split(".")[0],
                                                            seen or self.clock.now())
            stale = leaders(found)
            stale = [n for n in stale if n not in hung]
            if not stale and now >= next_link_check and len(pending) > 1:
                next_link_check = now + 1.0
                watched = self.roster.with_followers(pending)
                if self.liveness.all_waiting(watched, self.deadline.seconds + LINK_GRACE_S,
                                             phases=frozenset({"reduce"})):
                    next_link_check = now + self.deadline.seconds
                    stale = self._find_unreachable(pending)
                    unreachable += stale
            if stale:
                hung += stale
                for name in stale:
                    self._judge_hang(name, work_hung)
                self.abort_generation()
                self._evict_hung(stale)  # killed: nothing more to wait for from them
                calls.drop(r for r in calls.pending if by_ref[r] in stale)
        calls.close()
        leave, self.departures.leave_now = self.departures.leave_now, False
        if not errors and not hung and not leave:
            return results
        self._confirm_survivors(errors, hung, list(results))
        hung_set = [h for h in dict.fromkeys(hung) if h not in errors or is_death(errors[h])]
        if hung_set:
            self._evict_hung([h for h in hung_set if h in self.roster.names])
            for h in hung_set:
                errors.pop(h, None)  # the death is the one we caused
        faulty = set(hung_set) | {n for n, e in errors.items() if is_death(e)}
        if unreachable and set(hung_set) <= set(unreachable) and not any(
                is_death(e) for n, e in errors.items() if n not in hung_set):
            failure: Failure = WorkerUnreachable(
                f"worker {', '.join(hung_set)} could not be reached by its peers (its "
                "process-group link is dead though it runs): evicted", workers=tuple(hung_set),
                step=step)
        elif self.departures.evacuating and (leave or errors):
            leaving = self.departures.evacuating
            failure = Preempted(
                f"{', '.join(leaving)} leave together: every replica holding the state got a "
                "preemption notice", workers=leaving, step=step)
        elif work_hung:
            name, (work, why) = next(iter(work_hung.items()))
            failure = WorkFault(
                f"{work.describe() if work else 'the work'} made no progress past its "
                f"deadline on more than one worker ({why}): the work, not a worker, is at "
                "fault (a deadlock or an endless loop on that data?); fix it, raise "
                "HangConfig(floor_s=...) if it is only slow, or set "
                "RecoveryPolicy(on_work_fault='skip') to skip its samples",
                workers=tuple(work_hung), step=step if step is not None else
                (work.step if work else None), work=work,
            )
        else:
            failure = classify(
            errors,
            hung=tuple(hung_set),
            preempting=tuple(sorted(self.departures.draining)),
            live_after=len([n for n in self.roster.names if n not in faulty]),
            step=step,
            )
        failure.settled = {n: e.settled for n, e in errors.items() if isinstance(e, PeerFailed)}
        if step is not None:
            self.log.emit(
                "step_failed",
                step=step,
                gen=self.roster.gen,
                kind=failure.kind,
                workers=list(failure.workers),
            )
        raise failure

    def _confirm_survivors(
        self, errors: dict[str, BaseException], hung: list[str], answered: list[str]
    ) -> None:
        """Workers killed together die a few milliseconds apart: one still running when its
        peer's death broke the collective answers with that error (or, done already, with
        its result), then dies itself. Beside a death or a hang, every other worker that
        answered is asked whether it is alive (a call beside any step, up to
        :data:`CONFIRM_S`); one that died gets its death as its error, so the failure is
        classified as what happened, not as what it looked like."""
        if not hung and not any(is_death(e) for e in errors.values()):
            return
        suspects = [n for n, e in errors.items() if not is_death(e) and n not in hung]
        suspects += [n for n in answered if n not in errors and n not in hung]
        handles = {h.name: h for h in self.roster.members if h.name in suspects}
        if not handles:
            return
        pings = {h.actor.alive.remote(): name for name, h in handles.items()}
        done, _ = ray.wait(list(pings), num_returns=len(pings), timeout=CONFIRM_S)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as err:
                if is_death(err):
                    errors[pings[ref]] = err

    def _report_wait(self, names: list[str], step: int | None, waited_s: float) -> None:
        """A long wait says who it waits for and what each one's heartbeat says (a call that
        is busy, not hung, can take this long: a checkpoint read, a long step)."""
        self.liveness.observe(names)
        seen = []
        for n in names:
            hb = self.liveness.last(n)
            what = "no heartbeat" if hb is None else f"{hb.phase} at step {hb.step}, gen {hb.gen}"
            seen.append(f"{n} ({what}, silent {self.liveness.silent_s(n):.1f} s)")
        _log.warning("waited %.0f s%s on %s", waited_s,
                     "" if step is None else f" for step {step}", "; ".join(seen))
        points.hit("calls.wait_reported", names=names, step=step, waited_s=waited_s,
                   liveness=self.liveness)

    def abort_generation(self) -> None:
        """Tells every member of this generation to abandon what it is doing: a call beside
        the step (:meth:`Worker.abort <planaria.worker.Worker.abort>`, so no worker polls
        for it), and ``abort/<gen>`` in the store for ranks waiting in a rendezvous."""
        if self._aborted_gen == self.roster.gen:
            return
        self._aborted_gen = self.roster.gen
        try:
            self.store.set(store_keys.abort(self.roster.gen), "1")
        except Exception:  # the store is ours; nothing to do if it fails but wait
            _log.debug("could not set abort/%d", self.roster.gen, exc_info=True)
        for handle in self.roster.members:  # fire and forget: a dead one needs no telling
            handle.actor.abort.remote(self.roster.gen)

    def _peer_moves(self, name: str) -> bool:
        """Another worker of ``name``'s replica is frozen or paused (its heartbeat silent,
        not yet past the heartbeat timeout) or makes progress (a busy micro-batch): ``name``
        may be waiting on it inside the replica's collectives."""
        live = self.liveness
        for peer in self.roster.with_followers([name.split(".", 1)[0]]):
            if peer == name:
                continue
            if live.silent_s(peer) > live.vouch_s and not live.stopped(peer):
                return True
            hb = live.last(peer)
            if hb is not None and live.still_s(peer) <= self._deadline_for(hb):
                return True
        return False

    def _find_unreachable(self, names: list[str]) -> list[str]:
        """Every rank of the run waits on its peers past the deadline: probes them all
        (planaria.control.links) and returns the replicas whose ranks cannot be reached (none when
        no one is to blame: the failure then rebuilds the generation on fresh links)."""
        from concurrent.futures import ThreadPoolExecutor

        from planaria.control.links import find_unreachable
        from planaria.wire.probes import probe

        watched = self.roster.with_followers(names)
        addresses: dict[str, str] = {}
        for n in watched:
            with contextlib.suppress(Exception):
                if self.store.check([store_keys.probe(n)]):
                    addresses[n] = self.store.get(store_keys.probe(n)).decode()
        with ThreadPoolExecutor(max_workers=max(1, len(addresses))) as pool:
            mine = dict(zip(addresses, pool.map(probe, addresses.values()), strict=True))
        asks = {}
        for h in self.roster.members:
            if h.name in names:
                peers = {n: a for n, a in addresses.items() if n.split(".")[0] != h.name}
                asks[h.actor.probe_links.remote(peers, 1.0)] = h.name
        done, _ = ray.wait(list(asks), num_returns=len(asks), timeout=2 * len(watched) + 2.0)
        reports = {}
        for ref in done:
            with contextlib.suppress(Exception):
                reports[asks[ref]] = ray.get(ref)
        verdict = find_unreachable(watched, mine, reports)
        self.log.emit("link_check", workers=watched, culprits=list(verdict.culprits),
                      reason=verdict.reason, controller_reached=mine,
                      reports={n: dataclasses.asdict(r) for n, r in reports.items()})
        culprits = leaders(list(verdict.culprits))
        for name in culprits:  # dated from its own record: when its wait on the peers began
            self.fault_times.stuck_since[name] = (
                self.liveness.last_progress_t(name, steps_only=True) or self.clock.now())
        if not culprits:
            _log.warning("every rank waited on its peers past the deadline and none could be "
                         "named (%s): the generation is built again", verdict.reason)
            self.abort_generation()
            raise WorkerLost("every rank waited on its peers past the deadline (a stalled "
                             f"link; {verdict.reason}): rebuilding on fresh connections",
                             workers=(), step=None)
        return culprits

    def _deadline_for(self, hb: Heartbeat) -> float:
        """How long a worker may make no progress on its current work: the step deadline, or
        the I/O deadline while it loads samples, times the work's patience (doubled for
        every worker that hung on it: see planaria.control.attribution)."""
        base = self.deadline.seconds
        if hb.phase == "loading":
            base = max(base, self.hang.io_timeout_s)
        return base * self.attribution.patience(work_of(hb))

    def _judge_hang(self, name: str, work_hung: dict[str, tuple[Work | None, str]]) -> None:
        """A worker is stuck in its own work (its heartbeat lives): is the work to blame?
        A stopped process (no heartbeat) is the process's, never the work's."""
        hb = self.liveness.last(name)
        if hb is None or self.liveness.stopped(name) or hb.phase not in WORK_PHASES:
            return
        # Dated from its own record: when its work stopped moving, not when it was found.
        self.fault_times.stuck_since[name] = (self.liveness.last_progress_t(name)
                                              or self.clock.now())
        work = work_of(hb)
        handle = next((h for h in self.roster.members if h.name == name), None)
        judgement = self.attribution.judge(
            Sighting(name, work, f"hung:{hb.phase}", how="hung",
                     node=None if handle is None else handle.ray_node),
            width=self.roster.width)
        self.log.emit("attribution", worker=name, work=None if work is None else work.describe(),
                      how="hung", blame=judgement.blame.value, reason=judgement.reason)
        if judgement.blame is Blame.WORK:
            work_hung[name] = (work, judgement.reason)

    def _past_deadline(self, names: list[str]) -> list[str]:
        """The last resort: past the call's deadline, whoever is not waiting on a peer; none
        while every one of them still moves checkpoint bytes (a slow read is not a hang)."""
        self.liveness.observe(names)
        if all(self.liveness.moving(n, IO_STALL_S) for n in names):
            return []
        working = [
            n for n in names
            if (hb := self.liveness.last(n)) is None or hb.phase in WORK_PHASES
        ]
        return working or names

    def _evict_hung(self, names: list[str]) -> None:
        for name in names:
            handle = next((h for h in self.roster.members if h.name == name), None)
            if handle is None:
                continue
            hb = self.liveness.last(name)
            stack = self.pool.stack(handle, timeout_s=0.5)
            self.log.emit(
                "hang_stack",
                worker=name,
                stack=stack,
                phase=None if hb is None else hb.phase,
                silent_s=round(self.liveness.silent_s(name), 3),
            )
            self.roster.evict([name])



def leaders(names: list[str]) -> list[str]:
    """The replicas (their leaders' names) that ``names`` belong to."""
    return list(dict.fromkeys(n.split(".", 1)[0] for n in names))


def work_of(hb: Heartbeat) -> Work | None:
    """The work a heartbeat names: ``m<j>`` micro-batch j of its step, ``i<id>`` a sample."""
    if hb.work.startswith("m") and hb.work[1:].isdigit():
        return Work(step=hb.step, micro_batch=int(hb.work[1:]))
    if hb.work.startswith("i") and hb.work[1:].isdigit():
        return Work(step=hb.step, sample=int(hb.work[1:]))
    return None
