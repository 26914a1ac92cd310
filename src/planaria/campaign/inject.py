"""The controller's side of fault injection: a :class:`Injector` hooked into the Job.

It runs in the job's controller process as a ``Job.hooks`` entry and names the
boundaries it needs (:meth:`Injector.next_step`), so the job trains in autonomous
runs between them. At the boundary ``fault.ahead`` steps before a fault's step
it arms it (after waiting, bounded, until the job is back at full width, its
spares warm, and the last trigger fired, so each fault recovers before the
next); the fault itself lands where the kind targets:

- inside a step: the target worker's own
  :class:`~planaria.campaign.knobs.CampaignLoss` acts on the planned micro-batch
  (a signal to itself or to the processes the trigger names, a NaN, a stall, a
  burst of compute, a full disk);
- inside a sample's load: the campaign's dataset wrapper
  (:mod:`planaria.campaign.dataset`) raises or sleeps;
- inside a checkpoint's write or a restore's reads, or the controller's commit:
  ``faulty://`` (:mod:`planaria.campaign.storage_faults`) kills or preempts the
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
fires, to ``CONTROL/fired.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planaria.campaign import dataset as campaign_dataset
from planaria.campaign import netfilter, procs, storage_faults
from planaria.campaign.knobs import arm_trigger
from planaria.campaign.mix import PlannedFault, PlannedRun
from planaria.chaos import send_signal
from planaria.data_plan import micro_batch_range

if TYPE_CHECKING:
    from planaria.controller import Job

__all__ = ["INJECTIONS_FILE", "Injector", "busy_s", "read_injections"]

INJECTIONS_FILE = "campaign_faults.jsonl"
BALLAST = "ballast"
STALE_STEPS = 6  # a compound fault's second half not seen this many steps later is given up
STARTING_WAIT_S = 120.0  # how long the ``starting`` watcher looks for the next worker process
_TRIGGERED = {"kill": "kill", "hang": "hang", "preempt": "preempt", "kill_rerun": "kill",
              "kill_join": "kill", "kill_restore": "nan", "storage_read": "nan",
              "nonfinite": "nan", "job_kill": "job_kill", "kill_starting": "kill",
              "kill_spare": "kill", "stall": "stall", "heavy_microbatch": "heavy",
              "pause": "pause", "fleet_preempt": "fleet", "gcs_kill": "kill_pids",
              "raylet_kill": "kill_pids", "kill_resumed": "job_kill",
              "link_stall": "cut_links"}
_SECONDARY_PHASE = {"kill_rerun": "rerun", "kill_join": "join", "kill_resumed": "resumed"}
# How the report must name a fault a worker trigger made: a kill or hang of the last replica
# holding the state is rightly "all_replicas_lost" (an earlier fault took the others).
_EXPECT = {"kill": ["worker_lost", "all_replicas_lost"],
           "hang": ["worker_hung", "all_replicas_lost"], "stall": ["worker_hung"],
           "preempt": ["preempted"], "nan": ["nonfinite_loss"],
           "cut_links": ["worker_unreachable"]}


def read_injections(run_dir: str | Path) -> list[dict[str, Any]]:
    return storage_faults.read_jsonl(Path(run_dir) / INJECTIONS_FILE)


def busy_s(fault: PlannedFault, step_s: float, deadline_s: float = 5.0) -> float:
    """How long a slow sample's load or a heavy micro-batch takes: 5 to 8 step lengths
    (past the step deadline's 4 x the slowest step), and at least 3 s past the job's
    deadline when it is armed (its 5 s floor; or a deadline an earlier slow step of the
    run raised)."""
    return round(min(120.0, max(deadline_s + 3.0, (5.0 + 3.0 * fault.draw) * step_s)), 3)


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
        snapshot: Callable[[Job], None] | None = None,
    ) -> None:
        self.run = run
        self.run_dir = Path(run_dir)
        self.control = Path(control)
        self.job_dir = Path(job_dir)
        self.replicas = run.shape.replicas
        self.spares = run.shape.spares
        self.incarnation = incarnation
        self.wait_s = wait_s
        self.snapshot = snapshot  # the weights before each fault: where a divergence began
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
        self.triggers: dict[str, dict[str, Any]] = {}  # fault id -> armed trigger, until fired
        self.frees: list[tuple[PlannedFault, int]] = []  # full disks, freed at that step
        last = stepped[-1].step if stepped else 0
        self.tail_step = last + 2 if stepped else None
        self._gcs: str | None = None

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
            blocked = self._unfired_until()
            blocked += [f.step + STALE_STEPS for p, (f, _) in self.waiting.items()
                        if p != "resumed"]
            wanted.append(max([self._arm_step(self.todo[0]), *blocked]))
        if "resumed" in self.waiting:
            wanted.append(after + 1)
        wanted += [step for _, step in self.frees]
        if self.tail_step is not None:
            wanted.append(self.tail_step)
        return max(after + 1, min(wanted)) if wanted else None

    def __call__(self, job: Job, phase: str, **info: Any) -> None:
        if phase == "boundary":
            self._boundary(job)
        elif phase == "save" and self.final is not None and job.steps_done >= self.run.steps:
            self._final_save(job, info["writers"])
        elif phase in self.waiting:
            self._secondary(job, phase, info)

    def _boundary(self, job: Job) -> None:
        self._rearm_lost(job)
        step = job.steps_done
        self._free_disks(job, step)
        rerun = self.waiting.get("rerun")
        if rerun is not None and self._fired(self._id(rerun[0], "primary")):
            fault, first = rerun
            del self.waiting["rerun"]
            victims = [n for n in job.names if n != first] or job.names
            self._trigger(job, fault, "secondary", "kill", victims[fault.target % len(victims)])
        if (self.final is not None and self.final.variant == "write" and not self.todo
                and self.tail_step is None):
            self._arm_final_write(job)
        resumed = self.waiting.get("resumed")
        if resumed is not None:
            job.wait_for_width(self.replicas, timeout_s=self.wait_s)
            del self.waiting["resumed"]
            fault = resumed[0]
            target = job.names[fault.target % len(job.names)]
            self._trigger(job, fault, "secondary", "kill", target, ahead=fault.ahead)
        if self.todo and step >= self._arm_step(self.todo[0]):
            job.wait_for_width(self.replicas, timeout_s=self.wait_s)  # a waiting join fires here
            if self.spares:
                job.wait_for_spares(timeout_s=self.wait_s)
            for phase, (fault, _) in list(self.waiting.items()):
                if phase != "resumed" and step >= fault.step + STALE_STEPS:
                    self._log(fault, "secondary", f"gave_up_{phase}", None, None, step)
                    del self.waiting[phase]
            blocked = [p for p in self.waiting if p != "resumed"]
            if not blocked and not any(step < s for s in self._unfired_until()):
                if self.snapshot is not None:
                    self.snapshot(job)
                self._arm(job, self.todo.pop(0))
        elif not self.todo and self.tail_step is not None and step >= self.tail_step:
            job.wait_for_width(self.replicas, timeout_s=self.wait_s)
            if self.spares:
                job.wait_for_spares(timeout_s=self.wait_s)
            self.tail_step = None  # the run ends at full width, pending joins done
            self._free_disks(job, step, all_of_them=True)
            if self.final is not None and self.final.variant == "write":
                self._arm_final_write(job)

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
        # Not a worker a preemption notice is draining at this very boundary (after the
        # hooks): the fault would land on a worker about to leave.
        draining = job.departures.draining
        names = [n for n in job.names if n not in draining] or job.names
        target = names[fault.target % len(names)]
        kind = fault.kind
        step = job.steps_done
        if kind == "slow":
            pid = self._pid(job, target)
            slow_s = max(1.0, min(3 * self.run.step_s, 20.0))
            self._log(fault, "primary", "slow", target, pid, step, slow_s=slow_s)
            storage_faults.log_fired(self.control, {"id": self._id(fault, "primary"),
                                                    "action": "slow"})
            send_signal("slow", pid, slow_s=slow_s)
            return
        if kind in ("storage_write", "storage_read"):
            op = kind.removeprefix("storage_")
            fid = self._id(fault, "primary")
            self._log(fault, "primary", kind, None, None, step)
            # "shard": a worker's shard file (the controller's own reads of shards, which
            # may tolerate errors, and a writer's read-back, are left alone); "any":
            # whichever file comes first.
            shard = fault.variant == "shard"
            storage_faults.arm(self.control, op, fault_id=fid,
                               match=".safetensors" if shard else "",
                               skip_pid=os.getpid() if shard else None,
                               skip_thread="planaria-ckpt" if shard and op == "read" else None)
        if kind in ("bad_sample", "slow_sample"):
            self._arm_sample(job, fault)
            return
        if kind == "disk_full":
            self._arm_disk(job, fault, target)
            return
        if kind in ("kill_save", "preempt_during_save"):
            self._arm_save(job, fault, target)
            return
        if kind == "controller_kill":
            self._arm_controller(job, fault, target)
            return
        if kind in _TRIGGERED:
            role = "trigger" if kind == "storage_read" else "primary"
            self._trigger(job, fault, role, self._action(fault), target,
                          ahead=self._steps_to(fault, job), **self._params(job, fault))
        if kind == "kill_restore":
            # Inside the restore's reads: the next shard a worker reads (not a writer's
            # read-back, which runs on the writer's thread) kills it part-way through.
            fid = self._id(fault, "secondary")
            self._log(fault, "secondary", "kill_read", None, None, step,
                      expect_victim="reader", expect=_EXPECT["kill"])
            storage_faults.arm(self.control, "read", fault_id=fid, match=".safetensors",
                               skip_pid=os.getpid(), skip_thread="planaria-ckpt",
                               action="kill", fraction=fault.fraction)
        if kind in ("kill_starting", "kill_spare"):
            # The next worker process to start is the replacement (or, with a spare taking
            # the place, the new spare): names are never reused, so it is any name not seen.
            self._watch_starting(job, fault)
        elif kind in _SECONDARY_PHASE and kind != "kill_resumed":
            self.waiting[_SECONDARY_PHASE[kind]] = (fault, target)

    def _action(self, fault: PlannedFault) -> str:
        if fault.kind == "kill_resumed" and fault.variant == "controller":
            return "kill_pids"
        return _TRIGGERED[fault.kind]

    def _params(self, job: Job, fault: PlannedFault) -> dict[str, Any]:
        """The trigger's own parameters, per kind."""
        kind = fault.kind
        if kind in ("heavy_microbatch",):
            return {"seconds": busy_s(fault, self.run.step_s, job.deadline.seconds)}
        if kind == "pause":
            deadline = job.hang.heartbeat_timeout_s
            return {"seconds": round(2.0 + max(0.0, deadline - 2.0) * fault.draw, 3)}
        if kind == "fleet_preempt":
            return {"pids": sorted(self._fleet(job).values()),
                    "grace_s": round(0.5 + 2.5 * fault.draw, 3)}
        if kind in ("gcs_kill", "raylet_kill"):
            binary = "gcs_server" if kind == "gcs_kill" else "raylet"
            return {"pids": procs.ray_children(os.getpid(), binary)}
        if kind == "kill_resumed" and fault.variant == "controller":
            return {"pids": [os.getpid()]}
        if kind == "link_stall":
            chain = netfilter.Chain(netfilter.run_chain(self.run.index))
            if not chain.create():
                raise RuntimeError("link_stall needs root and iptables (netfilter)")
            fleet = self._fleet(job)
            target = job.names[fault.target % len(job.names)]
            return {"peers": sorted(p for n, p in fleet.items() if n.split(".")[0] != target),
                    "chain": chain.name}
        return {}

    def _fleet(self, job: Job) -> dict[str, int]:
        """Every process of every member: the leaders and, in a sharded replica, the
        followers (found from their markers, this job's Ray instance only)."""
        out = {h.name: self._pid(job, h.name) for h in job.members}
        for name, pid in procs.job_workers(self._gcs_address()).items():
            if name.split(".", 1)[0] in out and "." in name:
                out[name] = pid
        return out

    def _gcs_address(self) -> str | None:
        if self._gcs is None:
            import ray

            self._gcs = str(ray.get_runtime_context().gcs_address)
        return self._gcs

    def _arm_sample(self, job: Job, fault: PlannedFault) -> None:
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
            self._log(fault, "primary", "bad_sample", None, None, job.steps_done, sample=sample,
                      from_step=step)
        else:
            seconds = busy_s(fault, self.run.step_s, job.deadline.seconds)
            campaign_dataset.arm_sample(self.control, fault_id=fid, sample=sample,
                                        action="sleep", from_step=step, sleep_s=seconds)
            self._log(fault, "primary", "slow_sample", None, None, job.steps_done,
                      sample=sample, from_step=step, seconds=seconds)

    def _arm_disk(self, job: Job, fault: PlannedFault, target: str) -> None:
        """A full disk, freed 2 to 4 steps after it first failed a write (at the run's tail
        at the latest): the checkpoint root through faulty://, or the run dir, a small
        tmpfs the campaign mounted, filled by a ballast file."""
        hold = 2 + int(fault.draw * 3)
        if fault.variant == "checkpoints":
            fid = self._id(fault, "primary")
            self._log(fault, "primary", "fill_checkpoints", None, None, job.steps_done,
                      hold_steps=hold)
            storage_faults.fill(self.control, fault_id=fid, fraction=fault.fraction)
        else:
            if not _is_tmpfs(self.job_dir):
                self._log(fault, "primary", "skipped", None, None, job.steps_done,
                          why=f"the run dir {self.job_dir} is not a tmpfs the campaign mounted "
                              "(mount refused?)")
                return
            self._trigger(job, fault, "primary", "fill", target,
                          ahead=self._steps_to(fault, job), path=str(self.job_dir / BALLAST))
        self.frees.append((fault, fault.step + hold))

    def _free_disks(self, job: Job, step: int, *, all_of_them: bool = False) -> None:
        for fault, at in list(self.frees):
            fired = self._fired(self._id(fault, "primary"))
            if not all_of_them and not (fired and step >= at):
                if not fired and step >= at:
                    self.frees.remove((fault, at))
                    self.frees.append((fault, step + 1))  # held until a write failed
                continue
            self.frees.remove((fault, at))
            if fault.variant == "checkpoints":
                storage_faults.free(self.control)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.job_dir / BALLAST)
            self._log(fault, "free", "free", None, None, step)

    def _arm_save(self, job: Job, fault: PlannedFault, target: str) -> None:
        """kill_save: SIGKILL to a writer inside the next save's snapshot (a timer at a
        drawn offset from the save's start) or part-way through its shard's bytes;
        preempt_during_save: SIGTERM to a writer part-way through its shard's bytes."""
        step = job.steps_done
        self._log(fault, "primary", "wait_save", None, None, step)
        if fault.kind == "kill_save" and fault.variant == "snapshot":
            self.waiting["save"] = (fault, target)
            return
        pid = self._pid(job, target)
        action = "kill" if fault.kind == "kill_save" else "term"
        self._log(fault, "secondary", f"{action}_write", target, pid, step, victims=[target],
                  expect=_EXPECT["kill" if action == "kill" else "preempt"])
        storage_faults.arm(self.control, "write", fault_id=self._id(fault, "secondary"),
                           match=".safetensors", only_pid=pid, action=action,
                           fraction=fault.fraction)

    def _arm_controller(self, job: Job, fault: PlannedFault, target: str) -> None:
        """SIGKILL to the controller alone: inside a step (a worker's trigger), or part-way
        through a commit's manifest or marker (faulty://, in the controller only)."""
        if fault.variant == "step":
            self._trigger(job, fault, "primary", "kill_pids", target,
                          ahead=self._steps_to(fault, job), pids=[os.getpid()])
            return
        fid = self._id(fault, "primary")
        match = "manifest.json" if fault.fraction < 0.5 else "COMMITTED"
        self._log(fault, "primary", "kill_commit", None, os.getpid(), job.steps_done,
                  match=match)
        storage_faults.arm(self.control, "write", fault_id=fid, match=match,
                           only_pid=os.getpid(), action="kill", fraction=fault.fraction)

    def _arm_final_write(self, job: Job) -> None:
        from planaria.checkpoint.layout import step_dir_name

        assert self.final is not None
        fault = self.final
        target = job.names[fault.target % len(job.names)]
        pid = self._pid(job, target)
        self._log(fault, "secondary", "kill_write", target, pid, job.steps_done,
                  victims=[target], expect=_EXPECT["kill"])
        storage_faults.arm(self.control, "write", fault_id=self._id(fault, "secondary"),
                           match=f"{step_dir_name(self.run.steps)}/", only_pid=pid,
                           action="kill", fraction=fault.fraction)
        self.final = None

    def _trigger(
        self, job: Job, fault: PlannedFault, role: str, action: str, target: str, *,
        ahead: int = 0, **params: Any,
    ) -> None:
        """Arms ``action`` in ``target``, to fire ``ahead`` steps after this boundary (its
        worker counts the micro-batches of those steps first)."""
        pid = self._pid(job, target)
        total = job.spec.global_batch_size // job.spec.micro_batch_size
        rank = job.names.index(target)  # its own share: ranks may differ by a micro-batch
        micro = max(1, micro_batch_range(total, max(1, job.width), rank)[1])
        micro = max(1, -(-micro // job.config.workers_per_replica))  # a sharded leader's own
        fid = self._id(fault, role)
        arm_trigger(self.control, pid, fault_id=fid, action=action,
                    micro_batch=ahead * micro + min(fault.micro_batch, micro - 1),
                    fraction=fault.fraction,
                    job_pgid=os.getpgid(0) if action == "job_kill" else None, **params)
        self.triggers[fid] = {"fault": fault, "role": role, "action": action, "pid": pid,
                              "step": job.steps_done, "params": params}
        victims = ([target] if action in ("kill", "hang", "preempt", "stall", "cut_links") else
                   sorted({n.split(".", 1)[0] for n in self._fleet(job)})
                   if action == "fleet" else [])
        self._log(fault, role, action, target, pid, job.steps_done, ahead=ahead,
                  victims=victims, expect=_EXPECT.get(action),
                  workers={h.name: h.pid for h in job.members}, **params)

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
            params = dict(trig["params"])
            if trig["action"] == "fleet":
                params["pids"] = sorted(self._fleet(job).values())
            self._trigger(job, fault, trig["role"], trig["action"], target, ahead=ahead,
                          **params)

    # ---- second halves -----------------------------------------------------------------------

    def _secondary(self, job: Job, phase: str, info: dict[str, Any]) -> None:
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

    def _final_save(self, job: Job, writers: list[str]) -> None:
        fault = self.final
        assert fault is not None
        self.final = None
        victim = writers[fault.target % len(writers)]
        self._log(fault, "primary", "final_save", None, None, job.steps_done)
        self._kill_later(job, fault, victim, fault.fraction * 0.02, "kill_final_snapshot")

    def _kill_later(self, job: Job, fault: PlannedFault, victim: str, delay_s: float,
                    action: str) -> None:
        pid = self._pid(job, victim)
        fid = self._id(fault, "secondary")
        self._log(fault, "secondary", action, victim, pid, job.steps_done, delay_s=delay_s,
                  victims=[victim], expect=_EXPECT["kill"])

        def kill() -> None:
            time.sleep(delay_s)
            storage_faults.log_fired(self.control, {"id": fid, "action": "kill"})
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

        threading.Thread(target=kill, name="campaign-kill", daemon=True).start()

    def _watch_starting(self, job: Job, fault: PlannedFault) -> None:
        """Kills the next worker process of this job to start (a replacement, or a spare
        warming up) inside its start, before it is ready: a drawn share of 0.3 s after the
        process appears (forked, or started by Ray), unless it is a member or a standby
        spare by then."""
        gcs = self._gcs_address()
        fid = self._id(fault, "secondary")
        self._log(fault, "secondary", "kill_starting", None, None, job.steps_done,
                  expect_event="replacement_failed")
        control, run_dir = self.control, self.run_dir
        known = procs.worker_processes(run_dir)
        delay = fault.fraction * 0.3

        def watch() -> None:
            end = time.monotonic() + STARTING_WAIT_S
            while time.monotonic() < end:
                new = procs.worker_processes(run_dir) - known
                if new:
                    pid = min(new)
                    time.sleep(delay)
                    names = {p: n for n, p in procs.job_workers(gcs).items()}
                    name = names.get(pid)
                    ready = {h.name for h in job.members} | {h.name for h in job.pool.standby}
                    if name in ready:
                        return  # ready already: too late (the verdict finds it never fired)
                    storage_faults.log_fired(control, {"id": fid, "action": "kill",
                                                       "worker": name, "victim_pid": pid})
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    return
                time.sleep(0.01)

        threading.Thread(target=watch, name="campaign-starting", daemon=True).start()

    @staticmethod
    def _state_bytes(job: Job) -> int:
        return max((int(h.info.get("param_bytes", 0)) for h in job.members), default=0)

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


def _is_tmpfs(path: Path) -> bool:
    """Whether ``path`` is the mount point of a tmpfs (the campaign's small run dir)."""
    target = str(Path(path).resolve())
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[1] == target and parts[2] == "tmpfs":
                return True
    return False
