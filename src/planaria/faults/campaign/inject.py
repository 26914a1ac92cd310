"""The controller's side of fault injection: a :class:`Injector` hooked into the Job.

It runs in the job's controller process as a ``Job.hooks`` entry and names the
boundaries it needs (:meth:`Injector.next_step`), so the job trains in autonomous
runs between them. At the boundary ``fault.ahead`` steps before a fault's step
it arms it (after waiting, bounded, until the job is back at full width, its
spares warm, and the last trigger fired, so each fault recovers before the
next); the fault itself lands where the kind targets:

- inside a step: the target worker's own
  :class:`~planaria.faults.campaign.knobs.CampaignLoss` acts on the planned micro-batch
  (a signal to itself or to the processes the trigger names, a NaN, a stall, a
  burst of compute, a full disk);
- inside a sample's load: the campaign's dataset wrapper
  (:mod:`planaria.faults.campaign.dataset`) raises or sleeps;
- inside a checkpoint's write or a restore's reads, or the controller's commit:
  ``faulty://`` (:mod:`planaria.faults.campaign.storage_faults`) kills or preempts the
  process part-way through the file's bytes, or fails its writes with ENOSPC;
- inside a save's snapshot, a state transfer: a timer thread here sends SIGKILL
  at a drawn offset into the window; inside a replacement's or a spare's start:
  a watcher thread finds the new worker process as it appears and kills it a
  drawn share of 0.3 s later, before it is ready.

The second half of a compound fault waits for its phase: ``rerun`` (a boundary
where the failed step is about to run again), ``join``, ``save``,
``resumed`` (the job started again); a watcher thread waits for the next worker
process to start (a replacement, or a spare). Every injection is logged to
``RUN_DIR/campaign_faults.jsonl`` (what was armed where: its ``victims``, the
workers it makes fail, and the report kinds it must appear as) and, when it
fires, to ``CONTROL/fired.jsonl`` (:mod:`planaria.faults.campaign.injections`).

The injector decides when and what; its parts arm: a worker's trigger
(:mod:`planaria.faults.campaign.triggers`), a ``faulty://`` open
(:mod:`planaria.faults.campaign.storage_arming`), a full disk
(:mod:`planaria.faults.campaign.full_disks`), a timed SIGKILL
(:mod:`planaria.faults.campaign.timed_kills`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planaria.faults.campaign import dataset as campaign_dataset
from planaria.faults.campaign import storage_faults
from planaria.faults.campaign.full_disks import FullDisks
from planaria.faults.campaign.injected_job import InjectedJob
from planaria.faults.campaign.injections import (
    INJECTIONS_FILE,
    InjectionLog,
    has_fired,
    read_injections,
)
from planaria.faults.campaign.mix import PlannedFault, PlannedRun
from planaria.faults.campaign.storage_arming import StorageArming
from planaria.faults.campaign.timed_kills import kill_after, kill_next_start
from planaria.faults.campaign.triggers import (
    EXPECTED_REPORTS,
    STALE_STEPS,
    TRIGGERED_ACTIONS,
    WorkerTriggers,
    busy_s,
    pid_of,
    steps_to,
)
from planaria.faults.chaos import send_signal

__all__ = ["INJECTIONS_FILE", "Injector", "busy_s", "read_injections"]

_SECONDARY_PHASE = {"kill_rerun": "rerun", "kill_join": "join", "kill_resumed": "resumed"}


class Injector:
    """Arms a run's planned faults at the Job's hook phases (see the module docstring)."""

    def __init__(
        self,
        run: PlannedRun,
        *,
        run_dir: Path,
        control: Path,
        job_dir: Path,
        incarnation: int,
        wait_s: float = 180.0,
        snapshot: Callable[[], None] | None = None,
    ) -> None:
        self.run = run
        self.run_dir = Path(run_dir)
        self.control = Path(control)
        self.job_dir = Path(job_dir)
        self.replicas = run.shape.replicas
        self.spares = run.shape.spares
        self.incarnation = incarnation
        self.wait_s = wait_s
        self.snapshot = snapshot  # saves the weights before each fault: where a divergence began
        self.log = InjectionLog(self.run_dir, run_index=run.index, incarnation=incarnation)
        self.triggers = WorkerTriggers(run, control=self.control, log=self.log)
        self.storage = StorageArming(self.control, self.log)
        self.disks = FullDisks(control=self.control, job_dir=self.job_dir, log=self.log,
                               triggers=self.triggers)
        records = read_injections(run_dir)
        done = {r["fault"] for r in records if r["role"] == "primary"}
        fired = {r.get("id") for r in storage_faults.fired(self.control)}
        stepped = [f for f in run.faults if f.kind != "kill_final_save"]
        self.todo = [f for f in stepped if f.index not in done]
        self.final = next((f for f in run.faults if f.kind == "kill_final_save"
                           and self._id(f, "secondary") not in fired), None)
        self.waiting: dict[str, tuple[PlannedFault, str | None]] = {}
        for f in run.faults:  # a compound fault whose second half is the resumed job's
            if (f.kind == "kill_resumed" and incarnation > 0 and f.index in done
                    and self._id(f, "secondary") not in {r["id"] for r in records}):
                self.waiting["resumed"] = (f, None)
        last = stepped[-1].step if stepped else 0
        self.tail_step = last + 2 if stepped else None

    # ---- the hook ----------------------------------------------------------------------------

    def next_step(self, after: int) -> int | None:
        """The next boundary this injector needs (the job's autonomous loop asks, see
        :meth:`~planaria.control.boundary.BoundaryPlanner.next_boundary`): where the next
        fault is armed, a disk is freed, or the run's tail begins; None when it needs
        none."""
        wanted = []
        if self.todo:
            # Armed only once the last trigger fired and no second half waits (each of those
            # ends a run when it happens: a boundary comes then), or once they went stale.
            blocked = self.triggers.unfired_until()
            blocked += [f.step + STALE_STEPS for p, (f, _) in self.waiting.items()
                        if p != "resumed"]
            wanted.append(max([self._arm_step(self.todo[0]), *blocked]))
        if "resumed" in self.waiting:
            wanted.append(after + 1)
        wanted += self.disks.due_steps()
        if self.tail_step is not None:
            wanted.append(self.tail_step)
        return max(after + 1, min(wanted)) if wanted else None

    def __call__(self, job: InjectedJob, phase: str, **info: Any) -> None:
        if phase == "boundary":
            self._boundary(job)
        elif phase == "save" and self.final is not None and job.steps_done >= self.run.steps:
            self._final_save(job, info["writers"])
        elif phase in self.waiting:
            self._secondary(job, phase, info)

    def _boundary(self, job: InjectedJob) -> None:
        self.triggers.rearm_lost(job)
        step = job.steps_done
        self.disks.free(step)
        rerun = self.waiting.get("rerun")
        if rerun is not None and self._fired(self._id(rerun[0], "primary")):
            fault, first = rerun
            del self.waiting["rerun"]
            victims = [n for n in job.names if n != first] or job.names
            self.triggers.arm(job, fault, "secondary", "kill",
                              victims[fault.target % len(victims)])
        if (self.final is not None and self.final.variant == "write" and not self.todo
                and self.tail_step is None):
            self._arm_final_write(job)
        resumed = self.waiting.get("resumed")
        if resumed is not None:
            job.wait_for_width(self.replicas, timeout_s=self.wait_s)
            del self.waiting["resumed"]
            fault = resumed[0]
            target = job.names[fault.target % len(job.names)]
            self.triggers.arm(job, fault, "secondary", "kill", target, ahead=fault.ahead)
        if self.todo and step >= self._arm_step(self.todo[0]):
            job.wait_for_width(self.replicas, timeout_s=self.wait_s)  # a waiting join fires here
            if self.spares:
                job.wait_for_spares(timeout_s=self.wait_s)
            for phase, (fault, _) in list(self.waiting.items()):
                if phase != "resumed" and step >= fault.step + STALE_STEPS:
                    self.log.write(fault, "secondary", f"gave_up_{phase}", None, None, step)
                    del self.waiting[phase]
            blocked = [p for p in self.waiting if p != "resumed"]
            if not blocked and not any(step < s for s in self.triggers.unfired_until()):
                if self.snapshot is not None:
                    self.snapshot()
                self._arm(job, self.todo.pop(0))
        elif not self.todo and self.tail_step is not None and step >= self.tail_step:
            job.wait_for_width(self.replicas, timeout_s=self.wait_s)
            if self.spares:
                job.wait_for_spares(timeout_s=self.wait_s)
            self.tail_step = None  # the run ends at full width, pending joins done
            self.disks.free(step, all_of_them=True)
            if self.final is not None and self.final.variant == "write":
                self._arm_final_write(job)

    # ---- arming ------------------------------------------------------------------------------

    @staticmethod
    def _arm_step(fault: PlannedFault) -> int:
        return max(0, fault.step - fault.ahead)

    def _arm(self, job: InjectedJob, fault: PlannedFault) -> None:
        # Not a worker a preemption notice is draining at this very boundary (after the
        # hooks): the fault would land on a worker about to leave.
        draining = job.departures.draining
        names = [n for n in job.names if n not in draining] or job.names
        target = names[fault.target % len(names)]
        kind = fault.kind
        step = job.steps_done
        if kind == "slow":
            pid = pid_of(job, target)
            slow_s = max(1.0, min(3 * self.run.step_s, 20.0))
            self.log.write(fault, "primary", "slow", target, pid, step, slow_s=slow_s)
            storage_faults.log_fired(self.control, {"id": self._id(fault, "primary"),
                                                    "action": "slow"})
            send_signal("slow", pid, slow_s=slow_s)
            return
        if kind in ("storage_write", "storage_read"):
            self.storage.error(fault, step)
        if kind in ("bad_sample", "slow_sample"):
            self._arm_sample(job, fault)
            return
        if kind == "disk_full":
            self.disks.fill(job, fault, target)
            return
        if kind in ("kill_save", "preempt_during_save"):
            self._arm_save(job, fault, target)
            return
        if kind == "controller_kill":
            self._arm_controller(job, fault, target)
            return
        if kind in TRIGGERED_ACTIONS:
            role = "trigger" if kind == "storage_read" else "primary"
            self.triggers.arm(job, fault, role, self.triggers.action(fault), target,
                              ahead=steps_to(fault, job), **self.triggers.params(job, fault))
        if kind == "kill_restore":
            self.storage.kill_reader(fault, step)
        if kind in ("kill_starting", "kill_spare"):
            # The next worker process to start is the replacement (or, with a spare taking
            # the place, the new spare): names are never reused, so it is any name not seen.
            self._watch_starting(job, fault)
        elif kind in _SECONDARY_PHASE and kind != "kill_resumed":
            self.waiting[_SECONDARY_PHASE[kind]] = (fault, target)

    def _arm_sample(self, job: InjectedJob, fault: PlannedFault) -> None:
        """A sample of a step at least two steps on (its load has not begun: the next step's
        share is loaded ahead), armed from that step on."""
        assert job.plan is not None
        step = max(fault.step, job.steps_done + 2)
        batch = job.plan.batch(step)
        sample = int(batch[fault.target % len(batch)])
        fid = self._id(fault, "primary")
        if fault.kind == "bad_sample":
            campaign_dataset.arm_sample(self.control, fault_id=fid, sample=sample,
                                        action="raise", from_step=step)
            self.log.write(fault, "primary", "bad_sample", None, None, job.steps_done,
                           sample=sample, from_step=step)
        else:
            seconds = busy_s(fault, self.run.step_s, job.deadline.seconds)
            campaign_dataset.arm_sample(self.control, fault_id=fid, sample=sample,
                                        action="sleep", from_step=step, sleep_s=seconds)
            self.log.write(fault, "primary", "slow_sample", None, None, job.steps_done,
                           sample=sample, from_step=step, seconds=seconds)

    def _arm_save(self, job: InjectedJob, fault: PlannedFault, target: str) -> None:
        """kill_save: SIGKILL to a writer inside the next save's snapshot (a timer at a
        drawn offset from the save's start) or part-way through its shard's bytes;
        preempt_during_save: SIGTERM to a writer part-way through its shard's bytes."""
        step = job.steps_done
        self.log.write(fault, "primary", "wait_save", None, None, step)
        if fault.kind == "kill_save" and fault.variant == "snapshot":
            self.waiting["save"] = (fault, target)
            return
        self.storage.signal_writer(fault, target, pid_of(job, target), step)

    def _arm_controller(self, job: InjectedJob, fault: PlannedFault, target: str) -> None:
        """SIGKILL to the controller alone: inside a step (a worker's trigger), or part-way
        through a commit's manifest or marker (faulty://, in the controller only)."""
        if fault.variant == "step":
            self.triggers.arm(job, fault, "primary", "kill_pids", target,
                              ahead=steps_to(fault, job), pids=[os.getpid()])
            return
        self.storage.kill_commit(fault, job.steps_done)

    def _arm_final_write(self, job: InjectedJob) -> None:
        assert self.final is not None
        fault = self.final
        target = job.names[fault.target % len(job.names)]
        self.storage.kill_final_writer(fault, target, pid_of(job, target), job.steps_done,
                                       self.run.steps)
        self.final = None

    # ---- second halves -----------------------------------------------------------------------

    def _secondary(self, job: InjectedJob, phase: str, info: dict[str, Any]) -> None:
        fault, _first = self.waiting[phase]
        if fault.kind not in ("kill_save",) and not self._fired(self._id(fault, "primary")):
            return
        if phase == "join":
            victim = info["src"] if fault.variant == "source" else info["joiners"][0]
            # inside the transfer: a drawn share of the time its bytes take on loopback
            window = max(0.005, self._state_bytes(job) / 2e8)
        elif phase == "save":
            writers = info["writers"]
            victim = writers[fault.target % len(writers)]
            window = 0.02  # the snapshot into staging buffers: milliseconds for these states
        else:
            return
        del self.waiting[phase]
        self._kill_later(job, fault, victim, fault.fraction * window, f"kill_{phase}")

    def _final_save(self, job: InjectedJob, writers: list[str]) -> None:
        fault = self.final
        assert fault is not None
        self.final = None
        victim = writers[fault.target % len(writers)]
        self.log.write(fault, "primary", "final_save", None, None, job.steps_done)
        self._kill_later(job, fault, victim, fault.fraction * 0.02, "kill_final_snapshot")

    def _kill_later(self, job: InjectedJob, fault: PlannedFault, victim: str, delay_s: float,
                    action: str) -> None:
        pid = pid_of(job, victim)
        self.log.write(fault, "secondary", action, victim, pid, job.steps_done, delay_s=delay_s,
                       victims=[victim], expect=EXPECTED_REPORTS["kill"])
        kill_after(self.control, self._id(fault, "secondary"), pid, delay_s)

    def _watch_starting(self, job: InjectedJob, fault: PlannedFault) -> None:
        """Kills the next worker process of this job to start (a replacement, or a spare
        warming up) inside its start, before it is ready: a drawn share of 0.3 s after the
        process appears (forked, or started by Ray), unless it is a member or a standby
        spare by then."""
        gcs = self.triggers.gcs_address()
        self.log.write(fault, "secondary", "kill_starting", None, None, job.steps_done,
                       expect_event="replacement_failed")
        kill_next_start(self.control, self.run_dir, self._id(fault, "secondary"), gcs=gcs,
                        delay_s=fault.fraction * 0.3,
                        ready=lambda: ({h.name for h in job.members}
                                       | {h.name for h in job.pool.standby}))

    @staticmethod
    def _state_bytes(job: InjectedJob) -> int:
        return max(((h.info.param_bytes if h.info else 0) for h in job.members), default=0)

    def _id(self, fault: PlannedFault, role: str) -> str:
        return self.log.fault_id(fault, role)

    def _fired(self, fault_id: str) -> bool:
        return has_fired(self.control, fault_id)
