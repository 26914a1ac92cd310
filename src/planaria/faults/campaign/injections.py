"""The campaign's record of its injections.

Every arming is a line of ``RUN_DIR/campaign_faults.jsonl``: the fault, its role
(``primary``, ``secondary``, ``trigger``, ``free``), what was armed where (its
``victims``: the workers it makes fail; ``expect``: the report kinds it must appear as)
and the job's incarnation. A firing is a line of ``CONTROL/fired.jsonl``
(:func:`planaria.faults.campaign.storage_faults.log_fired`), under the same fault id.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from planaria.faults.campaign import storage_faults
from planaria.faults.campaign.mix import PlannedFault

__all__ = ["INJECTIONS_FILE", "InjectionLog", "has_fired", "read_injections"]

INJECTIONS_FILE = "campaign_faults.jsonl"


def read_injections(run_dir: str | Path) -> list[dict[str, Any]]:
    return storage_faults.read_jsonl(Path(run_dir) / INJECTIONS_FILE)


def has_fired(control: Path, fault_id: str) -> bool:
    return any(r.get("id") == fault_id for r in storage_faults.fired(control))


class InjectionLog:
    """Appends one job incarnation's armings to its run's record."""

    def __init__(self, run_dir: Path, *, run_index: int, incarnation: int) -> None:
        self.path = Path(run_dir) / INJECTIONS_FILE
        self.run_index = run_index
        self.incarnation = incarnation

    def fault_id(self, fault: PlannedFault, role: str) -> str:
        return f"r{self.run_index}f{fault.index}.{role}"

    def write(
        self, fault: PlannedFault, role: str, action: str, worker: str | None, pid: int | None,
        step: int, **extra: Any,
    ) -> None:
        record = {"fault": fault.index, "kind": fault.kind, "role": role, "action": action,
                  "id": self.fault_id(fault, role), "worker": worker, "pid": pid, "step": step,
                  "incarnation": self.incarnation, "t": time.time(), **extra}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
