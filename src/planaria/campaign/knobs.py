"""Inside the workers: the step-length knob and the one-shot triggers, in the spec's loss.

:class:`CampaignLoss` wraps the spec's loss. Every micro-batch takes at least
``delay_s`` (a sleep after the real loss: the worker is busy, as with a slower
model), so step lengths from milliseconds to many seconds train the same
numbers. The controller arms a fault by writing ``CONTROL/trigger-<pid>.json``
for one worker at a step boundary, before the step is dispatched; that worker
counts its loss calls from then on and fires on the planned micro-batch, at the
planned fraction of its compute: it takes the trigger (an atomic rename, so a
trigger fires once), logs it durably to ``CONTROL/fired.jsonl`` and then sends
itself the real signal (or returns a NaN loss, or SIGKILLs the whole job).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Imported for its side effect: every worker that unpickles this loss can open faulty:// roots.
from planaria.campaign import storage_faults

__all__ = ["ACTIONS", "CampaignLoss", "arm_trigger"]

ACTIONS = ("kill", "hang", "preempt", "nan", "job_kill")
_SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "preempt": signal.SIGTERM}


def arm_trigger(
    control: str | Path,
    pid: int,
    *,
    fault_id: str,
    action: str,
    micro_batch: int,
    fraction: float,
    job_pgid: int | None = None,
) -> Path:
    """Arms a one-shot trigger in worker ``pid`` (see the module docstring)."""
    if action not in ACTIONS:
        raise ValueError(f"action={action!r} is not valid: one of {', '.join(ACTIONS)}")
    path = Path(control) / f"trigger-{pid}.json"
    body = {"id": fault_id, "action": action, "micro_batch": micro_batch, "fraction": fraction,
            "job_pgid": job_pgid}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)
    return path


class CampaignLoss:
    """The spec's loss, stretched to ``delay_s`` per micro-batch, with the campaign's triggers."""

    def __init__(self, inner: Callable[[Any, Any], Any], *, delay_s: float, control: str) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.control = control
        self._armed: dict[str, Any] | None = None
        self._calls = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner, "delay_s": self.delay_s, "control": self.control}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["inner"], delay_s=state["delay_s"], control=state["control"])  # type: ignore[misc]

    def __call__(self, model: Any, batch: Any) -> Any:
        out = self.inner(model, batch)
        trigger = self._poll()
        if trigger is None or self._calls != int(trigger["micro_batch"]):
            self._calls += 1
            self._sleep(self.delay_s)
            return out
        self._sleep(self.delay_s * float(trigger["fraction"]))
        out = self._fire(trigger, out)
        self._sleep(self.delay_s * (1.0 - float(trigger["fraction"])))
        return out

    def _poll(self) -> dict[str, Any] | None:
        path = os.path.join(self.control, f"trigger-{os.getpid()}.json")
        try:
            with open(path) as f:
                trigger = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            self._armed = None
            return None
        if self._armed is None or self._armed["id"] != trigger["id"]:
            self._armed = {**trigger, "_path": path}
            self._calls = 0  # count this trigger's micro-batches from its first sight
        return self._armed

    def _fire(self, trigger: dict[str, Any], out: Any) -> Any:
        taken = f"{trigger['_path']}.fired"
        try:
            os.rename(trigger["_path"], taken)
        except FileNotFoundError:  # disarmed by the controller meanwhile
            return out
        action = trigger["action"]
        storage_faults.log_fired(self.control, {"id": trigger["id"], "action": action})
        if action == "nan":
            return _nan(out)
        if action == "job_kill":
            os.killpg(int(trigger["job_pgid"]), signal.SIGKILL)
            return out
        os.kill(os.getpid(), _SIGNALS[action])
        return out

    @staticmethod
    def _sleep(seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


def _nan(out: Any) -> Any:
    if isinstance(out, tuple):
        return (out[0] * math.nan, *out[1:])
    return out * math.nan
