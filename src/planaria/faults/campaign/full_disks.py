"""Full disks: armed, held a few steps past the first write they failed, then freed.

The checkpoint root fills through ``faulty://`` (every write fails part-way with
ENOSPC); the run dir, a small tmpfs the campaign mounted, fills by a ballast file a
worker's trigger writes.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from planaria.faults.campaign import storage_faults
from planaria.faults.campaign.injected_job import InjectedJob
from planaria.faults.campaign.injections import InjectionLog, has_fired
from planaria.faults.campaign.mix import PlannedFault
from planaria.faults.campaign.triggers import WorkerTriggers, steps_to

__all__ = ["BALLAST", "FullDisks", "is_tmpfs"]

BALLAST = "ballast"


class FullDisks:
    """The disks one run's faults filled, and the step each is freed at."""

    def __init__(self, *, control: Path, job_dir: Path, log: InjectionLog,
                 triggers: WorkerTriggers) -> None:
        self.control = control
        self.job_dir = job_dir
        self.log = log
        self.triggers = triggers
        self.frees: list[tuple[PlannedFault, int]] = []  # full disks, freed at that step

    def due_steps(self) -> list[int]:
        return [step for _, step in self.frees]

    def fill(self, job: InjectedJob, fault: PlannedFault, target: str) -> None:
        """A full disk, freed 2 to 4 steps after it first failed a write (at the run's tail
        at the latest): the checkpoint root through faulty://, or the run dir, a small
        tmpfs the campaign mounted, filled by a ballast file."""
        hold = 2 + int(fault.draw * 3)
        if fault.variant == "checkpoints":
            fid = self.log.fault_id(fault, "primary")
            self.log.write(fault, "primary", "fill_checkpoints", None, None, job.steps_done,
                           hold_steps=hold)
            storage_faults.fill(self.control, fault_id=fid, fraction=fault.fraction)
        else:
            if not is_tmpfs(self.job_dir):
                self.log.write(fault, "primary", "skipped", None, None, job.steps_done,
                               why=f"the run dir {self.job_dir} is not a tmpfs the campaign "
                                   "mounted (mount refused?)")
                return
            self.triggers.arm(job, fault, "primary", "fill", target,
                              ahead=steps_to(fault, job), path=str(self.job_dir / BALLAST))
        self.frees.append((fault, fault.step + hold))

    def free(self, step: int, *, all_of_them: bool = False) -> None:
        """Frees the disks due at ``step`` (a disk that failed no write yet is held on)."""
        for fault, at in list(self.frees):
            fired = has_fired(self.control, self.log.fault_id(fault, "primary"))
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
            self.log.write(fault, "free", "free", None, None, step)


def is_tmpfs(path: Path) -> bool:
    """Whether ``path`` is the mount point of a tmpfs (the campaign's small run dir)."""
    target = str(Path(path).resolve())
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[1] == target and parts[2] == "tmpfs":
                return True
    return False
