"""Inside the workers: the step-length knob and the one-shot triggers, in the spec's loss.

:class:`CampaignLoss` wraps the spec's loss. Every micro-batch takes at least
``delay_s`` (a sleep after the real loss: the worker is busy, as with a slower
model), so step lengths from milliseconds to many seconds train the same
numbers. The controller arms a fault by writing ``CONTROL/trigger-<pid>.json``
for one worker at a step boundary, before the step is dispatched; that worker
counts its loss calls from then on and fires on the planned micro-batch, at the
planned fraction of its compute: it takes the trigger (an atomic rename, so a
trigger fires once), logs it durably to ``CONTROL/fired.jsonl`` and then acts:

- ``kill``, ``hang``, ``preempt``: SIGKILL, SIGSTOP, SIGTERM to itself;
- ``nan``: returns a NaN loss;
- ``job_kill``: SIGKILL to the job's process group; ``kill_pids``: SIGKILL to the
  processes the trigger names (the controller alone, the job's GCS, its raylet);
- ``fleet``: SIGTERM to every process the trigger names (every member of the
  job, itself too) at once, then SIGKILL to them ``grace_s`` later (from a
  detached shell: the senders die);
- ``stall``: blocks its thread for good on an event never set (the heartbeat
  thread lives on);
- ``heavy``: burns the CPU for ``seconds`` (matrix products: busy, no progress
  between micro-batches);
- ``pause``: one SIGSTOP, SIGCONT ``seconds`` later (from a detached shell);
- ``fill``: fills the file system holding ``path`` with a ballast file there;
- ``cut_links``: drops every TCP flow between itself and the ``peers`` processes, both
  ways, with netfilter rules in ``chain`` (planaria.faults.campaign.netfilter): its process group's
  links die while it and its heartbeat live.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Imported for its side effect: every worker that unpickles this loss can open faulty:// roots.
from planaria.faults.campaign import storage_faults

__all__ = ["ACTIONS", "CampaignLoss", "arm_trigger", "fill_disk"]

ACTIONS = ("kill", "hang", "preempt", "nan", "job_kill", "kill_pids", "fleet", "stall", "heavy",
           "pause", "fill", "cut_links")
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
    **params: Any,
) -> Path:
    """Arms a one-shot trigger in worker ``pid`` (see the module docstring); ``params`` are
    the action's (``pids``, ``grace_s``, ``seconds``, ``path``)."""
    if action not in ACTIONS:
        raise ValueError(f"action={action!r} is not valid: one of {', '.join(ACTIONS)}")
    path = Path(control) / f"trigger-{pid}.json"
    body = {"id": fault_id, "action": action, "micro_batch": micro_batch, "fraction": fraction,
            "job_pgid": job_pgid, **params}
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
        record = {"id": trigger["id"], "action": action}
        for key in ("pids", "grace_s", "seconds"):
            if key in trigger:
                record[key] = trigger[key]
        storage_faults.log_fired(self.control, record)
        if action == "nan":
            return _nan(out)
        if action == "job_kill":
            os.killpg(int(trigger["job_pgid"]), signal.SIGKILL)
        elif action == "kill_pids":
            _signal_all(trigger["pids"], signal.SIGKILL)
        elif action == "fleet":
            _later(float(trigger["grace_s"]), "KILL", trigger["pids"])
            _signal_all(trigger["pids"], signal.SIGTERM)
        elif action == "stall":
            threading.Event().wait()  # never set: this thread is stuck for good
        elif action == "heavy":
            _burn(float(trigger["seconds"]))
        elif action == "pause":
            pid = os.getpid()
            _detached(f"kill -STOP {pid}; sleep {float(trigger['seconds']):.3f}; kill -CONT {pid}")
            time.sleep(0.05)  # stopped within this sleep
        elif action == "fill":
            fill_disk(str(trigger["path"]))
        elif action == "cut_links":
            from planaria.faults.campaign.netfilter import cut_links

            cut_links([int(p) for p in trigger["peers"]], str(trigger["chain"]))
        else:
            os.kill(os.getpid(), _SIGNALS[action])
        return out

    @staticmethod
    def _sleep(seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(int(pid), sig)
        except ProcessLookupError:
            continue


def _detached(script: str) -> None:
    """Runs a shell script in a session of its own: it outlives this process."""
    subprocess.Popen(["/bin/sh", "-c", script], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)


def _later(seconds: float, sig: str, pids: list[int]) -> None:
    _detached(f"sleep {seconds:.3f}; kill -{sig} {' '.join(str(int(p)) for p in pids)} "
              "2>/dev/null")


def _burn(seconds: float) -> int:
    """Computes for ``seconds``: matrix products of a fixed matrix (no random generator).
    Returns how many it computed."""
    import torch

    a = torch.full((192, 192), 1.0 / 192)
    end = time.monotonic() + seconds
    products = 0
    while time.monotonic() < end:
        for _ in range(8):
            a = torch.mm(a, a).clamp_(0.0, 1.0 / 192)
        products += 8
    return products


def fill_disk(path: str) -> None:
    """Fills the file system holding ``path`` with the file ``path`` (all its free space)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        free = os.statvfs(os.path.dirname(path) or ".")
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, free.f_bavail * free.f_frsize)
        chunk = b"\0" * (1 << 16)
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                os.lseek(fd, 0, os.SEEK_END)
                if os.write(fd, chunk) <= 0:
                    break
    finally:
        os.close(fd)


def _nan(out: Any) -> Any:
    if isinstance(out, tuple):
        return (out[0] * math.nan, *out[1:])
    return out * math.nan
