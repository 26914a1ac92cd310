"""Faults armed on the next matching open of a ``faulty://`` file
(:func:`planaria.faults.campaign.storage_faults.arm`), each logged to the run's injection record
first: an I/O error, a SIGKILL part-way through a restore's read, a writer's SIGKILL or
SIGTERM part-way through its shard, the controller's SIGKILL part-way through a commit."""

from __future__ import annotations

import os
from pathlib import Path

from planaria.faults.campaign import storage_faults
from planaria.faults.campaign.injections import InjectionLog
from planaria.faults.campaign.mix import PlannedFault
from planaria.faults.campaign.triggers import EXPECTED_REPORTS

__all__ = ["StorageArming"]


class StorageArming:
    """Arms one run's storage faults in ``control`` and logs them to ``log``."""

    def __init__(self, control: Path, log: InjectionLog) -> None:
        self.control = control
        self.log = log

    def error(self, fault: PlannedFault, step: int) -> None:
        """storage_write, storage_read: an EIO at the open."""
        op = fault.kind.removeprefix("storage_")
        fid = self.log.fault_id(fault, "primary")
        self.log.write(fault, "primary", fault.kind, None, None, step)
        # "shard": a worker's shard file (the controller's own reads of shards, which
        # may tolerate errors, and a writer's read-back, are left alone); "any":
        # whichever file comes first.
        shard = fault.variant == "shard"
        storage_faults.arm(self.control, op, fault_id=fid,
                           match=".safetensors" if shard else "",
                           skip_pid=os.getpid() if shard else None,
                           skip_thread="planaria-ckpt" if shard and op == "read" else None)

    def kill_reader(self, fault: PlannedFault, step: int) -> None:
        """Inside the restore's reads: the next shard a worker reads (not a writer's
        read-back, which runs on the writer's thread) kills it part-way through."""
        fid = self.log.fault_id(fault, "secondary")
        self.log.write(fault, "secondary", "kill_read", None, None, step,
                       expect_victim="reader", expect=EXPECTED_REPORTS["kill"])
        storage_faults.arm(self.control, "read", fault_id=fid, match=".safetensors",
                           skip_pid=os.getpid(), skip_thread="planaria-ckpt",
                           action="kill", fraction=fault.fraction)

    def signal_writer(self, fault: PlannedFault, target: str, pid: int, step: int) -> None:
        """kill_save: SIGKILL, preempt_during_save: SIGTERM to ``target`` part-way through
        its next shard's bytes."""
        action = "kill" if fault.kind == "kill_save" else "term"
        self.log.write(fault, "secondary", f"{action}_write", target, pid, step,
                       victims=[target],
                       expect=EXPECTED_REPORTS["kill" if action == "kill" else "preempt"])
        storage_faults.arm(self.control, "write", fault_id=self.log.fault_id(fault, "secondary"),
                           match=".safetensors", only_pid=pid, action=action,
                           fraction=fault.fraction)

    def kill_commit(self, fault: PlannedFault, step: int) -> None:
        """SIGKILL to the controller part-way through a commit's manifest or marker."""
        fid = self.log.fault_id(fault, "primary")
        match = "manifest.json" if fault.fraction < 0.5 else "COMMITTED"
        self.log.write(fault, "primary", "kill_commit", None, os.getpid(), step, match=match)
        storage_faults.arm(self.control, "write", fault_id=fid, match=match,
                           only_pid=os.getpid(), action="kill", fraction=fault.fraction)

    def kill_final_writer(self, fault: PlannedFault, target: str, pid: int, step: int,
                          final_step: int) -> None:
        """SIGKILL to ``target`` part-way through its shard of the final save."""
        from planaria.checkpoint.layout import step_dir_name

        self.log.write(fault, "secondary", "kill_write", target, pid, step,
                       victims=[target], expect=EXPECTED_REPORTS["kill"])
        storage_faults.arm(self.control, "write", fault_id=self.log.fault_id(fault, "secondary"),
                           match=f"{step_dir_name(final_step)}/", only_pid=pid,
                           action="kill", fraction=fault.fraction)
