"""Faults armed inside a worker's step: the trigger its
:class:`~planaria.faults.campaign.knobs.CampaignLoss` fires on a planned micro-batch.

:class:`WorkerTriggers` arms one (``CONTROL/trigger-<pid>.json``, counted in the target's
own micro-batches from this boundary), logs it, keeps it until it fires, and moves it to
a live worker when its worker left the job first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from planaria.data.plan import micro_batch_range
from planaria.faults.campaign import netfilter, procs, storage_faults
from planaria.faults.campaign.injected_job import InjectedJob
from planaria.faults.campaign.injections import InjectionLog, has_fired
from planaria.faults.campaign.knobs import arm_trigger
from planaria.faults.campaign.mix import PlannedFault, PlannedRun

__all__ = ["EXPECTED_REPORTS", "STALE_STEPS", "TRIGGERED_ACTIONS", "WorkerTriggers", "busy_s",
           "pid_of", "steps_to"]

STALE_STEPS = 6  # a compound fault's second half not seen this many steps later is given up
TRIGGERED_ACTIONS = {
    "kill": "kill", "hang": "hang", "preempt": "preempt", "kill_rerun": "kill",
    "kill_join": "kill", "kill_restore": "nan", "storage_read": "nan",
    "nonfinite": "nan", "job_kill": "job_kill", "kill_starting": "kill",
    "kill_spare": "kill", "stall": "stall", "heavy_microbatch": "heavy",
    "pause": "pause", "fleet_preempt": "fleet", "gcs_kill": "kill_pids",
    "raylet_kill": "kill_pids", "kill_resumed": "job_kill",
    "link_stall": "cut_links"}
"""The kinds a worker's trigger makes (or begins), and the trigger's action."""
# How the report must name a fault a worker trigger made: a kill or hang of the last replica
# holding the state is rightly "all_replicas_lost" (an earlier fault took the others).
EXPECTED_REPORTS = {"kill": ["worker_lost", "all_replicas_lost"],
                    "hang": ["worker_hung", "all_replicas_lost"], "stall": ["worker_hung"],
                    "preempt": ["preempted"], "nan": ["nonfinite_loss"],
                    "cut_links": ["worker_unreachable"]}


def busy_s(fault: PlannedFault, step_s: float, deadline_s: float = 5.0) -> float:
    """How long a slow sample's load or a heavy micro-batch takes: 5 to 8 step lengths
    (past the step deadline's 4 x the slowest step), and at least 3 s past the job's
    deadline when it is armed (its 5 s floor; or a deadline an earlier slow step of the
    run raised)."""
    return round(min(120.0, max(deadline_s + 3.0, (5.0 + 3.0 * fault.draw) * step_s)), 3)


def steps_to(fault: PlannedFault, job: InjectedJob) -> int:
    """Steps from this boundary to the fault's own step (0 if it is late)."""
    return max(0, fault.step - job.steps_done)


def pid_of(job: InjectedJob, name: str) -> int:
    pid = next(h.pid for h in job.members if h.name == name)
    assert pid is not None, f"{name} has no pid"
    return pid


class WorkerTriggers:
    """The triggers armed in workers and not fired yet (see the module docstring)."""

    def __init__(self, run: PlannedRun, *, control: Path, log: InjectionLog) -> None:
        self.run = run
        self.control = control
        self.log = log
        self.armed: dict[str, dict[str, Any]] = {}  # fault id -> armed trigger, until fired
        self._gcs: str | None = None

    def unfired_until(self) -> list[int]:
        """Per trigger armed and not fired yet (its worker would see a new one instead):
        the step until which the next fault waits for it (STALE_STEPS after its arming)."""
        fired = {r.get("id") for r in storage_faults.fired(self.control)}
        return [t["step"] + STALE_STEPS for fid, t in self.armed.items() if fid not in fired]

    def arm(
        self, job: InjectedJob, fault: PlannedFault, role: str, action: str, target: str, *,
        ahead: int = 0, **params: Any,
    ) -> None:
        """Arms ``action`` in ``target``, to fire ``ahead`` steps after this boundary (its
        worker counts the micro-batches of those steps first)."""
        pid = pid_of(job, target)
        total = job.spec.global_batch_size // job.spec.micro_batch_size
        rank = job.names.index(target)  # its own share: ranks may differ by a micro-batch
        micro = max(1, micro_batch_range(total, max(1, job.width), rank)[1])
        micro = max(1, -(-micro // job.config.workers_per_replica))  # a sharded leader's own
        fid = self.log.fault_id(fault, role)
        arm_trigger(self.control, pid, fault_id=fid, action=action,
                    micro_batch=ahead * micro + min(fault.micro_batch, micro - 1),
                    fraction=fault.fraction,
                    job_pgid=os.getpgid(0) if action == "job_kill" else None, **params)
        self.armed[fid] = {"fault": fault, "role": role, "action": action, "pid": pid,
                           "step": job.steps_done, "params": params}
        victims = ([target] if action in ("kill", "hang", "preempt", "stall", "cut_links") else
                   sorted({n.split(".", 1)[0] for n in self.fleet(job)})
                   if action == "fleet" else [])
        self.log.write(fault, role, action, target, pid, job.steps_done, ahead=ahead,
                       victims=victims, expect=EXPECTED_REPORTS.get(action),
                       workers={h.name: h.pid for h in job.members}, **params)

    def rearm_lost(self, job: InjectedJob) -> None:
        """A trigger whose worker left before it fired moves to a live worker."""
        live = {h.pid: h.name for h in job.members}
        for fid, trig in list(self.armed.items()):
            path = self.control / f"trigger-{trig['pid']}.json"
            if has_fired(self.control, fid) or not path.exists():
                del self.armed[fid]
                continue
            if trig["pid"] in live:
                continue
            path.unlink(missing_ok=True)
            del self.armed[fid]
            fault = trig["fault"]
            target = job.names[fault.target % len(job.names)]
            ahead = steps_to(fault, job) if trig["role"] != "secondary" else 0
            params = dict(trig["params"])
            if trig["action"] == "fleet":
                params["pids"] = sorted(self.fleet(job).values())
            self.arm(job, fault, trig["role"], trig["action"], target, ahead=ahead, **params)

    def action(self, fault: PlannedFault) -> str:
        if fault.kind == "kill_resumed" and fault.variant == "controller":
            return "kill_pids"
        return TRIGGERED_ACTIONS[fault.kind]

    def params(self, job: InjectedJob, fault: PlannedFault) -> dict[str, Any]:
        """The trigger's own parameters, per kind."""
        kind = fault.kind
        if kind in ("heavy_microbatch",):
            return {"seconds": busy_s(fault, self.run.step_s, job.deadline.seconds)}
        if kind == "pause":
            deadline = job.hang.heartbeat_timeout_s
            return {"seconds": round(2.0 + max(0.0, deadline - 2.0) * fault.draw, 3)}
        if kind == "fleet_preempt":
            return {"pids": sorted(self.fleet(job).values()),
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
            fleet = self.fleet(job)
            target = job.names[fault.target % len(job.names)]
            return {"peers": sorted(p for n, p in fleet.items() if n.split(".")[0] != target),
                    "chain": chain.name}
        return {}

    def fleet(self, job: InjectedJob) -> dict[str, int]:
        """Every process of every member: the leaders and, in a sharded replica, the
        followers (found from their markers, this job's Ray instance only)."""
        out = {h.name: pid_of(job, h.name) for h in job.members}
        for name, pid in procs.job_workers(self.gcs_address()).items():
            if name.split(".", 1)[0] in out and "." in name:
                out[name] = pid
        return out

    def gcs_address(self) -> str | None:
        if self._gcs is None:
            import ray

            self._gcs = str(ray.get_runtime_context().gcs_address)
        return self._gcs

