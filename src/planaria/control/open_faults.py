"""Faults from their detection to their first committed step: the records the recovery
metrics (``detect_s``, ``recover_s``, ``lost_steps``) are computed from."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planaria.faults.errors import Failure, WorkFault
from planaria.observe.logs import RESTATES

if TYPE_CHECKING:
    from planaria.control.departures import FaultTimes
    from planaria.control.protocols import StepCount
    from planaria.observe.events import EventLog

__all__ = ["OpenFault", "OpenFaults"]

_log = logging.getLogger("planaria.faults.user_code")


@dataclass
class OpenFault:
    """A fault being recovered from: its id, when it happened, the steps it lost."""

    fault_id: int
    fault_t: float
    lost_steps: int = 0


class OpenFaults:
    """The faults not recovered from yet (each is, at the next committed step)."""

    def __init__(self, *, log: EventLog, fault_times: FaultTimes, steps: StepCount) -> None:
        self.log = log
        self.fault_times = fault_times
        self.steps = steps
        self._open: list[OpenFault] = []
        self._next_fault_id = 0

    def __bool__(self) -> bool:
        return bool(self._open)

    def open(self, failure: Failure) -> OpenFault:
        """Records ``failure`` as a fault (``fault`` and ``detected`` events), dated by
        :class:`FaultTimes`."""
        fault_t = self.fault_times.fault_time(failure.workers)
        fault = OpenFault(self._next_fault_id, fault_t)
        self._next_fault_id += 1
        now = time.time()
        common = {"fault_id": fault.fault_id, "kind": failure.kind}
        # A work fault blames no worker: the workers it failed on are named apart.
        work_fault = isinstance(failure, WorkFault)
        worker = None if work_fault else ",".join(failure.workers) or None
        extra: dict[str, Any] = {"seen_on": list(failure.workers)} if work_fault else {}
        if failure.work is not None:
            extra["work"] = failure.work.describe()
        self.log.emit(
            "fault",
            **common,
            worker=worker,
            step=failure.step if failure.step is not None else self.steps.steps_done,
            fault_t=fault_t,
            message=str(failure).splitlines()[0] if str(failure) else failure.kind,
            **extra,
        )
        self.log.emit("detected", **common, worker=worker, detect_s=max(0.0, now - fault_t))
        _log.warning("%s: %s", failure.kind, failure, extra={RESTATES: "fault"})
        self._open.append(fault)
        return fault

    def discard(self, fault: OpenFault) -> None:
        """``fault`` ends the job: it will not be recovered from."""
        self._open.remove(fault)

    def close_all(self, step: int, now: float) -> None:
        """Step ``step`` committed at ``now``: every open fault is recovered from."""
        for fault in self._open:
            self.log.emit(
                "recovered",
                fault_id=fault.fault_id,
                step=step,
                recover_s=now - fault.fault_t,
                lost_steps=fault.lost_steps,
            )
        self._open.clear()
