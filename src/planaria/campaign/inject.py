"""The controller's side of fault injection: a :class:`Injector` hooked into the Job.

It runs in the job's controller process as a ``Job.hooks`` entry and names the
boundaries it needs (:meth:`Injector.next_step`), so the job trains in autonomous
runs between them. At the boundary ``fault.ahead`` steps before a fault's step
it arms it (after waiting, bounded, until the job is back at full width and the
last trigger fired, so each fault recovers before the next); the signal itself
lands inside that step, maybe in the middle of a run, sent by the target
worker's own :class:`~planaria.campaign.knobs.CampaignLoss` on the planned
micro-batch. The
second half of a compound fault waits for its phase: ``rerun`` (a boundary
where the failed step is about to run again), ``join``, ``save``, ``restore``.
Every injection is logged to ``RUN_DIR/campaign_faults.jsonl`` (what was armed
where) and, when it fires, to ``CONTROL/fired.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planaria.campaign import storage_faults
from planaria.campaign.knobs import arm_trigger
from planaria.campaign.mix import PlannedFault, PlannedRun
from planaria.chaos import send_signal
from planaria.data_plan import micro_batch_range

if TYPE_CHECKING:
    from planaria.controller import Job

__all__ = ["INJECTIONS_FILE", "Injector", "read_injections"]

INJECTIONS_FILE = "campaign_faults.jsonl"
_TRIGGERED = {"kill": "kill", "hang": "hang", "preempt": "preempt", "kill_rerun": "kill",
              "kill_join": "kill", "kill_restore": "nan", "storage_read": "nan",
              "nonfinite": "nan", "job_kill": "job_kill"}
STALE_STEPS = 6  # a compound fault's second half not seen this many steps later is given up
_SECONDARY_PHASE = {"kill_rerun": "rerun", "kill_join": "join", "kill_save": "save",
                    "kill_restore": "restore"}


def read_injections(run_dir: str | Path) -> list[dict[str, Any]]:
    return storage_faults.read_jsonl(Path(run_dir) / INJECTIONS_FILE)


class Injector:
    """Arms a run's planned faults at the Job's hook phases (see the module docstring)."""

    def __init__(
        self,
        run: PlannedRun,
        *,
        run_dir: Path,
        control: Path,
        replicas: int,
        incarnation: int,
        wait_s: float = 180.0,
        snapshot: Callable[[Job], None] | None = None,
    ) -> None:
        self.run = run
        self.run_dir = Path(run_dir)
        self.control = Path(control)
        self.replicas = replicas
        self.incarnation = incarnation
        self.wait_s = wait_s
        self.snapshot = snapshot  # the weights before each fault: where a divergence began
        done = {r["fault"] for r in read_injections(run_dir) if r["role"] == "primary"}
        self.todo = [f for f in run.faults if f.index not in done]
        self.waiting: dict[str, tuple[PlannedFault, str | None]] = {}
        self.triggers: dict[str, dict[str, Any]] = {}  # fault id -> armed trigger, until fired
        last = run.faults[-1].step if run.faults else 0
        self.tail_step = last + 2 if run.faults else None

    # ---- the hook ----------------------------------------------------------------------------

    def next_step(self, after: int) -> int | None:
        """The next boundary this injector needs (the job's autonomous loop asks, see
        :meth:`RunAhead.next_boundary <planaria.run_ahead.RunAhead.next_boundary>`): where
        the next fault is armed, or where the run's tail begins; None when it needs none."""
        wanted = []
        if self.todo:
            # Armed only once the last trigger fired and no second half waits (each of those
            # ends a run when it happens: a boundary comes then), or once they went stale.
            blocked = self._unfired_until()
            blocked += [f.step + STALE_STEPS for f, _ in self.waiting.values()]
            wanted.append(max([self._arm_step(self.todo[0]), *blocked]))
        if self.tail_step is not None:
            wanted.append(self.tail_step)
        return max(after + 1, min(wanted)) if wanted else None

    def __call__(self, job: Job, phase: str, **info: Any) -> None:
        if phase == "boundary":
            self._boundary(job)
        elif phase in self.waiting:
            self._secondary(job, phase, info)

    def _boundary(self, job: Job) -> None:
        self._rearm_lost(job)
        step = job.steps_done
        rerun = self.waiting.get("rerun")
        if rerun is not None and self._fired(self._id(rerun[0], "primary")):
            fault, first = rerun
            del self.waiting["rerun"]
            victims = [n for n in job.names if n != first] or job.names
            self._trigger(job, fault, "secondary", "kill", victims[fault.target % len(victims)])
        if self.todo and step >= self._arm_step(self.todo[0]):
            job.wait_for_width(self.replicas, timeout_s=self.wait_s)  # a waiting join fires here
            for phase, (fault, _) in list(self.waiting.items()):
                if step >= fault.step + STALE_STEPS:
                    self._log(fault, "secondary", f"gave_up_{phase}", None, None, step)
                    del self.waiting[phase]
            if not self.waiting and not any(step < s for s in self._unfired_until()):
                if self.snapshot is not None:
                    self.snapshot(job)
                self._arm(job, self.todo.pop(0))
        elif not self.todo and self.tail_step is not None and step >= self.tail_step:
            job.wait_for_width(self.replicas, timeout_s=self.wait_s)
            self.tail_step = None  # the run ends at full width, pending joins done

    # ---- arming ------------------------------------------------------------------------------

    @staticmethod
    def _arm_step(fault: PlannedFault) -> int:
        return max(0, fault.step - fault.ahead)

    def _unfired_until(self) -> list[int]:
        """Per trigger armed and not fired yet (its worker would see a new one instead):
        the step until which the next fault waits for it (STALE_STEPS after its arming)."""
        fired = {r.get("id") for r in storage_faults.fired(self.control)}
        return [t["step"] + STALE_STEPS for fid, t in self.triggers.items() if fid not in fired]

    @staticmethod
    def _steps_to(fault: PlannedFault, job: Job) -> int:
        """Steps from this boundary to the fault's own step (0 if it is late)."""
        return max(0, fault.step - job.steps_done)

    def _arm(self, job: Job, fault: PlannedFault) -> None:
        names = job.names
        target = names[fault.target % len(names)]
        kind = fault.kind
        if kind == "slow":
            pid = self._pid(job, target)
            slow_s = max(1.0, min(3 * self.run.step_s, 20.0))
            self._log(fault, "primary", "slow", target, pid, job.steps_done, slow_s=slow_s)
            storage_faults.log_fired(self.control, {"id": self._id(fault, "primary"),
                                                    "action": "slow"})
            send_signal("slow", pid, slow_s=slow_s)
            return
        if kind in ("storage_write", "storage_read"):
            op = kind.removeprefix("storage_")
            fid = self._id(fault, "primary")
            self._log(fault, "primary", kind, None, None, job.steps_done)
            # "shard": a worker's shard file (the controller's own reads of shards, which
            # may tolerate errors, are left alone); "any": whichever file comes first.
            shard = fault.variant == "shard"
            storage_faults.arm(self.control, op, fault_id=fid,
                               match=".safetensors" if shard else "",
                               skip_pid=os.getpid() if shard else None)
        if kind in _TRIGGERED:
            role = "trigger" if kind == "storage_read" else "primary"
            self._trigger(job, fault, role, _TRIGGERED[kind], target,
                          ahead=self._steps_to(fault, job))
        if kind in _SECONDARY_PHASE:
            self.waiting[_SECONDARY_PHASE[kind]] = (fault, target)
            if kind == "kill_save":
                self._log(fault, "primary", "wait_save", None, None, job.steps_done)

    def _trigger(
        self, job: Job, fault: PlannedFault, role: str, action: str, target: str, *, ahead: int = 0,
    ) -> None:
        """Arms ``action`` in ``target``, to fire ``ahead`` steps after this boundary (its
        worker counts the micro-batches of those steps first)."""
        pid = self._pid(job, target)
        total = job.spec.global_batch_size // job.spec.micro_batch_size
        rank = job.names.index(target)  # its own share: ranks may differ by a micro-batch
        micro = max(1, micro_batch_range(total, max(1, job.width), rank)[1])
        fid = self._id(fault, role)
        arm_trigger(self.control, pid, fault_id=fid, action=action,
                    micro_batch=ahead * micro + min(fault.micro_batch, micro - 1),
                    fraction=fault.fraction,
                    job_pgid=os.getpgid(0) if action == "job_kill" else None)
        self.triggers[fid] = {"fault": fault, "role": role, "action": action, "pid": pid,
                              "step": job.steps_done}
        self._log(fault, role, action, target, pid, job.steps_done, ahead=ahead,
                  workers={h.name: h.pid for h in job.members} if action == "job_kill" else None)

    def _rearm_lost(self, job: Job) -> None:
        """A trigger whose worker left before it fired moves to a live worker."""
        live = {h.pid: h.name for h in job.members}
        for fid, trig in list(self.triggers.items()):
            path = self.control / f"trigger-{trig['pid']}.json"
            if self._fired(fid) or not path.exists():
                del self.triggers[fid]
                continue
            if trig["pid"] in live:
                continue
            path.unlink(missing_ok=True)
            del self.triggers[fid]
            fault = trig["fault"]
            target = job.names[fault.target % len(job.names)]
            ahead = self._steps_to(fault, job) if trig["role"] != "secondary" else 0
            self._trigger(job, fault, trig["role"], trig["action"], target, ahead=ahead)

    def _secondary(self, job: Job, phase: str, info: dict[str, Any]) -> None:
        fault, _first = self.waiting[phase]
        if fault.kind != "kill_save" and not self._fired(self._id(fault, "primary")):
            return
        if phase == "join":
            victim = info["src"] if fault.variant == "source" else info["joiners"][0]
        elif phase == "save":
            writers = info["writers"]
            victim = writers[fault.target % len(writers)]
        else:
            victim = job.names[fault.target % len(job.names)]
        del self.waiting[phase]
        pid = self._pid(job, victim)
        role = "secondary"
        fid = self._id(fault, role)
        self._log(fault, role, f"kill_{phase}", victim, pid, job.steps_done)
        storage_faults.log_fired(self.control, {"id": fid, "action": "kill"})
        os.kill(pid, signal.SIGKILL)

    # ---- records -----------------------------------------------------------------------------

    def _id(self, fault: PlannedFault, role: str) -> str:
        return f"r{self.run.index}f{fault.index}.{role}"

    def _fired(self, fault_id: str) -> bool:
        return any(r.get("id") == fault_id for r in storage_faults.fired(self.control))

    @staticmethod
    def _pid(job: Job, name: str) -> int:
        pid = next(h.pid for h in job.members if h.name == name)
        assert pid is not None, f"{name} has no pid"
        return pid

    def _log(
        self, fault: PlannedFault, role: str, action: str, worker: str | None, pid: int | None,
        step: int, **extra: Any,
    ) -> None:
        record = {"fault": fault.index, "kind": fault.kind, "role": role, "action": action,
                  "id": self._id(fault, role), "worker": worker, "pid": pid, "step": step,
                  "incarnation": self.incarnation, "t": time.time(), **extra}
        with (self.run_dir / INJECTIONS_FILE).open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
