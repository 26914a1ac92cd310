"""What the controller does when something fails: the policy applied, in-process.

:class:`Recovery` turns a classified :class:`~planaria.faults.errors.Failure` into an
action (resize, pause, restore, drain, skip, rollback, abort), carries it out
on the controller's parts (:mod:`planaria.control`), and logs every stage so that
``detect_s``, ``recover_s``, ``lost_steps``, ``replacement_s`` and ``join_s`` can
be computed from the event log alone.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from planaria.checkpoint.errors import NoViableCheckpoint
from planaria.control.blame import away_from, judge_raised, samples_of
from planaria.control.decide import Action, decide
from planaria.control.open_faults import OpenFault, OpenFaults
from planaria.control.replacements import Replacements
from planaria.faults import points
from planaria.faults.errors import (
    ElasticRuntimeError,
    Failure,
    NonFiniteLoss,
    Preempted,
    UserCodeError,
    WorkFault,
)

if TYPE_CHECKING:
    from planaria.config import TrainSpec
    from planaria.control.attribution import Attribution
    from planaria.control.commit_log import CommitLog
    from planaria.control.departures import Departures, FaultTimes
    from planaria.control.membership import Membership
    from planaria.control.notices import Notices
    from planaria.control.policy import RecoveryPolicy
    from planaria.control.pool import WorkerHandle
    from planaria.control.protocols import Checkpoints, Gather, RayCheck
    from planaria.observe.events import EventLog

__all__ = ["Recovery", "SavedSteps"]

_log = logging.getLogger("planaria.faults.user_code")
MAX_CASCADE = 20  # failures handled back to back (a fault during a recovery) before giving up


class SavedSteps(Protocol):
    """Commits the steps up to ``step`` that leavers applied and a save beside them holds,
    though no run reported them (:meth:`RunAhead.adopt_saved
    <planaria.control.run_ahead.RunAhead.adopt_saved>`); returns the steps committed."""

    def adopt_saved(self, step: int) -> list[int]: ...


class Recovery:
    """The recovery policy at work on one group.

    ``check_ray(cause=failure)`` raises RayLost when Ray's own processes died (the failure
    is their consequence); ``replicas``: the width asked for; ``checkpoints``: None when
    checkpointing is off.
    """

    def __init__(
        self, *, policy: RecoveryPolicy, spec: TrainSpec, replicas: int,
        membership: Membership, calls: Gather, commit_log: CommitLog, notices: Notices,
        departures: Departures, fault_times: FaultTimes, attribution: Attribution,
        checkpoints: Checkpoints | None, saved_steps: SavedSteps, log: EventLog,
        check_ray: RayCheck,
    ) -> None:
        self.policy = policy
        self.spec = spec
        self.replicas = replicas
        self.membership = membership
        self.calls = calls
        self.commit_log = commit_log
        self.notices = notices
        self.departures = departures
        self.fault_times = fault_times
        self.attribution = attribution
        self.checkpoints = checkpoints
        self.saved_steps = saved_steps
        self.log = log
        self.check_ray = check_ray
        self.failures = 0
        self.preemptions = 0
        self.nonfinite = 0
        self._rolled_back: set[int] = set()  # steps already rolled back for a non-finite value
        self.faults = OpenFaults(log=log, fault_times=fault_times, steps=commit_log)
        self._joining: dict[str, float] = {}
        self._current: Failure | None = None  # the failure being handled, for chaining
        self.replacements = Replacements(membership.pool, enabled=policy.replace_workers)

    # ---- entry points ------------------------------------------------------------------------

    def handle(self, failure: Failure) -> None:
        """Recovers from ``failure`` (and from any failure during that recovery), or raises.

        Raises the UserCodeError itself for a bug in user code, and
        ElasticRuntimeError (chained to the failure) when the policy gives up, RayLost
        when the failure followed the death of Ray's GCS or raylet (its consequence).
        """
        self.check_ray(cause=failure)
        self.replacements.start_owed()  # the resumed step did not commit: they start now
        for _ in range(MAX_CASCADE):
            try:
                self._handle_one(failure)
                return
            except (UserCodeError, ElasticRuntimeError):
                raise
            except Failure as again:
                _log.warning("failure during recovery: %s", again)
                failure = again
        raise ElasticRuntimeError(f"{MAX_CASCADE} failures in a row during recovery") from failure

    def open_work(self) -> bool:
        """Faults or joins wait for their first committed step (which closes them)."""
        return bool(self.faults) or bool(self._joining)

    def on_commit(self, step: int, now: float | None = None) -> None:
        """After each committed step (at ``now``): owed replacements start, open faults and
        pending joins close."""
        group = self.membership
        now = time.time() if now is None else now
        group.settle_receipts()  # a joiner's state, sent beside its first step, has arrived
        self.replacements.start_owed()
        self.faults.close_all(step, now)
        for name, since in list(self._joining.items()):
            # A joiner that is no member now died before its first step (its loss is a
            # fault of its own): it must not keep the job one step at a time for good.
            del self._joining[name]
            if name in group.names:
                self.log.emit("joined", worker=name, gen=group.gen, step=step, join_s=now - since)

    def admit(self, ready: list[WorkerHandle]) -> None:
        """Brings ready replacements into the next generation; a survivor sends them the state."""
        points.hit("recovery.admit", recovery=self, ready=ready)
        group = self.membership
        if not group.members:  # nothing to send them: the restore path takes them
            return
        room = self.replicas - group.width
        for handle in ready[room:]:  # never wider than asked: extra replacements go home
            group.pool.release(handle)
        ready = ready[: max(0, room)]
        if not ready:
            return
        for handle in ready:
            self._joining[handle.name] = handle.ready_t or time.time()
        group.build_generation(group.members + ready, reason="join")

    def drain(self, names: list[str]) -> None:
        """Preempted workers leave at a step boundary: no failed step, nothing lost."""
        group = self.membership
        names = [n for n in names if n in group.names]
        if not names:
            return
        ck = self.checkpoints
        group.settle_receipts()
        holders = [h.name for h in group.members if h.has_state]
        receiving = any(h.receiving is not None for h in group.members)
        if not (names := self.notices.stay_for_receivers(names, holders, receiving)):
            return
        if (set(holders) <= set(names) and ck is not None and ck.can_save
                and ck.config.save_on_preemption):
            # Every holder of the state leaves: the step in hand is saved before anyone goes,
            # then they go together and replacements restore it (nothing trained is lost).
            self.departures.evacuating = tuple(names)
            notice = Preempted(f"{', '.join(names)} preempted: every replica holding the "
                               "state got a notice", workers=tuple(names))
            self._current = notice
            fault = self.faults.open(notice)
            ck.save_now(reason="preemption")
            self.evacuate(fault)
            return
        if len(names) == group.width:
            # Every member got a notice: the last one stays (a notice leaves time) until a
            # replacement has received the state from it, so the state never leaves the group.
            keep = names[-1]
            names = names[:-1]
            self.notices.keep_draining(keep)
            if not names:
                if not self.replacements.coming:
                    self.replacements.start([keep])
                return
        notice = Preempted(f"{', '.join(names)} preempted", workers=tuple(names))
        self._current = notice
        fault = self.faults.open(notice)
        self.preemptions += len(names)
        if self.preemptions > self.policy.max_preemptions:
            self._abort(
                f"{self.preemptions} preemptions, more than max_preemptions="
                f"{self.policy.max_preemptions}",
                None,
            )
        self.log.emit("action", fault_id=fault.fault_id, action="drain")
        remaining = group.width - len(names)
        if remaining < self.policy.min_replicas and self.checkpoints is not None:
            self.checkpoints.save_now(reason="preemption")  # just in time, before state leaves
        if self.checkpoints is not None:  # a shard they are writing goes with them
            self.checkpoints.writers_settle(names, timeout_s=self.checkpoints.config.timeout_s)
        for name in names:
            self.log.emit("drained", worker=name, step=self.commit_log.steps_done)
        group.evict(names)
        self.replacements.start(names)
        self._continue(reason="drain")

    # ---- one failure -------------------------------------------------------------------------

    def _handle_one(self, failure: Failure) -> None:
        group = self.membership
        group.settle_receipts()  # who holds the state: a joiner's that all arrived counts
        judged = judge_raised(failure, self.attribution, self.membership.members,
                              self.membership.width)
        if judged is not None and judged[0] is not failure:
            failure = judged[0]
        self._current = failure
        fault = self.faults.open(failure)
        if judged is not None and judged[1] is not None:
            self.log.emit("attribution", fault_id=fault.fault_id, worker=",".join(failure.workers),
                         work=None if failure.work is None else failure.work.describe(),
                         how="raised", blame=judged[1].blame.value, reason=judged[1].reason)
        gone = set(failure.workers)
        decision = decide(
            failure, blame=None if judged is None or judged[1] is None else judged[1].blame,
            policy=self.policy, failures_before=self.failures,
            evacuating=bool(self.departures.evacuating),
            holders_left=any(h.has_state for h in group.members if h.name not in gone))
        action = decision.action
        if action is Action.WORK_FAULT:
            assert isinstance(failure, WorkFault)
            self._work_fault(failure, fault)
            return
        if action is Action.EVACUATE:
            self.evacuate(fault)
            return
        if action is Action.ABORT_USER_CODE:
            self.log.emit("action", fault_id=fault.fault_id, action="abort")
            self.faults.discard(fault)
            self._save_what_is_safe()
            raise failure
        if action is Action.NONFINITE:
            assert isinstance(failure, NonFiniteLoss)
            self._nonfinite(failure, fault)
            return
        self.failures += decision.counted
        if action is Action.RETRY_ELSEWHERE:
            self._retry_elsewhere(failure, fault)
            return
        evicted: tuple[str, ...] = ()
        if decision.evict:
            group.evict(failure.workers)
            evicted = failure.workers
            # The no-holder restore is logged as "restore"; the rest as the policy names it.
            self.log.emit("action", fault_id=fault.fault_id,
                          action="restore" if action is Action.RESTORE
                          and not decision.keep_survivors else self.policy.on_worker_lost)
        if action is Action.ABORT:
            self._abort(decision.reason, failure)
        if action is Action.RESTORE:
            self.replacements.start(evicted)
            self._restore(fault, keep_survivors=decision.keep_survivors)
            return
        self._continue(reason="resize", pause=action is Action.PAUSE, replace=evicted)

    def _nonfinite(self, failure: NonFiniteLoss, fault: OpenFault) -> None:
        group = self.membership
        policy = self.policy
        self.nonfinite += 1
        if self.nonfinite > policy.max_nonfinite:
            self.faults.discard(fault)
            self._abort(
                f"{self.nonfinite} non-finite steps, more than max_nonfinite="
                f"{policy.max_nonfinite}",
                failure,
            )
        action = policy.on_nonfinite
        step = failure.step if failure.step is not None else self.commit_log.steps_done
        if action == "rollback" and step in self._rolled_back:
            # The same step is poisoned again after a rollback: it is the data, not a glitch.
            _log.warning("step %d is non-finite again after a rollback: skipping it", step)
            action = "skip"
        if action == "rollback" and self.checkpoints is None:
            self.faults.discard(fault)
            self._abort(
                "on_nonfinite='rollback' needs checkpoints to roll back to: pass checkpoint="
                "CheckpointConfig(every=...) or choose on_nonfinite='skip'",
                failure,
            )
        self.log.emit("action", fault_id=fault.fault_id, action=action)
        if action == "abort":
            self.faults.discard(fault)
            self._abort("the loss is not finite and on_nonfinite='abort'", failure)
        if action == "skip":
            self.commit_log.skip_pending(step, gen=group.gen)
            return
        self._rolled_back.add(step)
        self._restore(fault, keep_survivors=True)

    def evacuate(self, fault: OpenFault) -> None:
        """Every replica holding the state got a notice and was saved beside its steps
        (Notices.poll): once the save is written (the leavers' shards in), they go, and
        replacements restore it: the steps trained are kept. If they were killed before
        their shards were written (a grace period shorter than the save), the event log
        says so and the newest older save is restored."""
        group = self.membership
        names = list(self.departures.evacuating)
        self.preemptions += len(names)
        self.log.emit("action", fault_id=fault.fault_id, action="evacuate")
        ck = self.checkpoints
        assert ck is not None
        t0 = time.time()
        step = ck.inflight_step
        ck.writers_settle(names, timeout_s=ck.config.timeout_s)
        ck.finish_inflight()
        if step is not None and ck.last_committed != step:
            self.log.emit("preemption_save_lost", step=step, waited_s=time.time() - t0,
                         reason="the replicas were gone before the save's shards were written: "
                         "their grace period was shorter than a save")
        elif step is not None and step > self.commit_log.steps_done:
            self.saved_steps.adopt_saved(step)  # applied, saved, never reported: committed
        for name in names:
            self.log.emit("drained", worker=name, step=self.commit_log.steps_done)
        group.evict(names)
        self.departures.evacuating = ()
        self.departures.draining.difference_update(names)
        self.replacements.start(names)
        if self.preemptions > self.policy.max_preemptions:
            self._abort(f"{self.preemptions} preemptions, more than max_preemptions="
                        f"{self.policy.max_preemptions}", None)
        self._restore(fault, keep_survivors=False)

    # ---- the work's fault or the worker's ------------------------------------------------------

    def _retry_elsewhere(self, failure: Failure, fault: OpenFault) -> None:
        """The first failure of its kind: nobody is evicted; the next generation puts the
        failing work on another worker (the same one at width 1) and the step runs again."""
        group = self.membership
        members = away_from(group.members, failure, self.spec)
        self.log.emit("action", fault_id=fault.fault_id, action="retry_elsewhere",
                     workers=[h.name for h in members])
        group.build_generation(members, reason="retry")

    def _work_fault(self, failure: WorkFault, fault: OpenFault) -> None:
        """The work is at fault: stop with a save (the default), or skip its samples and go
        on (``on_work_fault="skip"``, up to ``max_skipped_samples``). Nobody is blamed; a
        worker killed because it was stuck on the work is replaced."""
        group = self.membership
        policy = self.policy
        samples = samples_of(self.commit_log.plan, self.spec, failure)
        room = policy.max_skipped_samples - len(self.commit_log.skipped_samples)
        if policy.on_work_fault == "skip" and samples and len(samples) <= room:
            self.log.emit("action", fault_id=fault.fault_id, action="skip", samples=samples)
            where = ", ".join(failure.workers)
            what = failure.work.describe() if failure.work is not None else "the work"
            self.commit_log.skip_samples(samples, step=failure.step,
                             reason=f"{what} failed the same way on {where}")
            gone = [n for n in failure.workers if n not in group.names]
            self.replacements.start(gone)
            if not any(h.has_state for h in group.members):
                self._restore(fault, keep_survivors=False)
                return
            self._continue(reason="skip")
            return
        why = ("on_work_fault='stop'" if policy.on_work_fault == "stop" else
               f"skipping {len(samples)} more samples would pass max_skipped_samples="
               f"{policy.max_skipped_samples}" if samples else "no samples to skip")
        self.log.emit("action", fault_id=fault.fault_id, action="abort", reason=why)
        self.faults.discard(fault)
        self._save_what_is_safe(reason="work_fault")
        ck = self.checkpoints
        if ck is not None and ck.last_committed is not None:
            kept = f"the job stops with step {ck.last_committed} saved under {ck.root}"
        else:
            kept = (f"checkpointing is off: the {self.commit_log.steps_done} steps trained "
                    "stop with the job (pass checkpoint=CheckpointConfig(every=...) to keep them)")
        raise WorkFault(f"{failure.args[0]} ({kept})", remote_traceback=failure.remote_traceback,
                        workers=failure.workers, step=failure.step, work=failure.work)

    # ---- actions -----------------------------------------------------------------------------

    def _continue(self, *, reason: str, pause: bool = False,
                  replace: tuple[str, ...] = ()) -> None:
        """Next generation from the survivors, after waiting for replacements if needed.
        ``replace``: lost workers, whose replacements start now where the width waits for
        them or a warm spare stands by (it joins this generation), else are owed
        (:mod:`planaria.control.replacements`)."""
        group = self.membership
        policy = self.policy
        want = self.replicas if pause else policy.min_replicas
        if group.width < want or group.pool.standby:
            self.replacements.start(replace)
            replace = ()
        joiners: list[WorkerHandle] = []
        if group.width < want:
            joiners = self._wait_for(want - group.width, reason)
        # A warm spare taken for this fault (or a replacement already up) joins in this very
        # generation: no step at reduced width, no second rendezvous.
        room = self.replicas - group.width - len(joiners)
        now = group.pool.poll(timeout_s=0.0)
        for handle in now[max(0, room):]:
            group.pool.release(handle)
        joiners += now[: max(0, room)]
        for handle in joiners:
            self._joining[handle.name] = handle.ready_t or time.time()
        self.replacements.owe(replace)
        group.build_generation(group.members + joiners, reason=reason)

    def _wait_for(self, count: int, reason: str) -> list[WorkerHandle]:
        group = self.membership
        timeout = self.policy.pause_timeout_s
        ready = group.wait_ready(count, timeout_s=timeout)
        if group.width + len(ready) < self.policy.min_replicas:
            for handle in ready:
                group.pool.kill(handle, fence=False)
            self._abort(
                f"only {group.width + len(ready)} replicas after waiting {timeout:g} s for "
                f"replacements ({reason}), below min_replicas={self.policy.min_replicas}: the "
                "cluster has no room for replacements; free resources, lower min_replicas or "
                "raise pause_timeout_s",
                None,
            )
        return ready

    def _restore(self, fault: OpenFault, *, keep_survivors: bool) -> None:
        """Reloads the newest viable checkpoint into every member, in this process."""
        group = self.membership
        need = (self.replicas if keep_survivors else self.policy.min_replicas) - group.width
        if need > 0:
            group.add(self._wait_for(need, "restore"))
        before = self.commit_log.steps_done
        group.set_holding(group.names, True)  # every member is about to be overwritten
        group.build_generation(group.members, reason="restore")
        try:
            restored = self.checkpoints.restore() if self.checkpoints is not None else None
        except NoViableCheckpoint as err:
            self._refuse_to_start_over(fault, before, f"no checkpoint could be restored ({err})",
                                       err)
            restored = None
        if restored is None:
            if self.checkpoints is None:
                where = "checkpointing is off: pass checkpoint=CheckpointConfig(every=...)"
            else:
                where = f"no checkpoint was saved under {self.checkpoints.root} yet"
            self._refuse_to_start_over(fault, before, f"no replica holds the state and {where}",
                                       None)
            restored = self._restart_from_scratch()
        fault.lost_steps = max(0, before - restored)

    def _refuse_to_start_over(
        self, fault: OpenFault, before: int, what: str, err: BaseException | None
    ) -> None:
        """Starting over from step 0 is never silent: an error unless the policy allows it
        (or nothing was trained yet)."""
        if before == 0 or self.policy.allow_restart_from_scratch:
            return
        why = (f"{what}; starting over would lose all {before} steps trained: set "
               "RecoveryPolicy(allow_restart_from_scratch=True) to allow it")
        self.log.emit("action", fault_id=fault.fault_id, action="abort", reason=why)
        raise ElasticRuntimeError(f"planaria gave up: {why}") from (err or self._current)

    def _restart_from_scratch(self) -> int:
        """No checkpoint (or none viable, where the policy allows it): fresh workers build the
        seed's initial state (the old ones, maybe half restored, are killed); training starts
        over."""
        group = self.membership
        _log.warning("no viable checkpoint: starting over from step 0")
        t0 = time.time()
        before = self.commit_log.steps_done
        fresh = [group.pool.start() for _ in group.members]
        group.kill_all()
        ready = group.wait_ready(len(fresh), timeout_s=self.policy.pause_timeout_s)
        if len(ready) < self.policy.min_replicas:
            self._abort("could not start fresh workers to start over", None)
        group.add(ready)
        group.set_holding(group.names, True)
        self.commit_log.restart_at(0)
        group.build_generation(group.members, reason="restore")
        # A ready worker may be a replacement that pre-built optimizer state: every member
        # goes back to the seed's initial state, and they must agree on it.
        sums = self.calls.gather(
            {h.name: h.actor.reinit.remote(group.gen) for h in group.members},
            deadline_s=self.policy.pause_timeout_s, step=None)
        if len(set(sums.values())) > 1:
            self._abort(f"fresh workers built different initial parameters {sums}", None)
        self.log.emit("restore", step=0, path=None, restore_s=time.time() - t0, lost_steps=before)
        return 0

    def _save_what_is_safe(self, reason: str = "user_code_error") -> None:
        group = self.membership
        if self.checkpoints is None or not group.members:
            return
        try:
            self.checkpoints.save_now(reason=reason)
        except Exception:
            _log.exception("could not save before stopping")

    def _abort(self, why: str, failure: Failure | None) -> None:
        self.log.emit("action", fault_id=None, action="abort", reason=why)
        raise ElasticRuntimeError(f"planaria gave up: {why}") from (failure or self._current)
