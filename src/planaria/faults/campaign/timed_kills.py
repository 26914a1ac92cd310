"""SIGKILLs timed from the controller: inside a window that has no file or step to hook
(a save's snapshot, a state transfer), and inside a worker process's start.

Each runs on a daemon thread and logs its firing to ``CONTROL/fired.jsonl`` the moment
before the signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from planaria.faults.campaign import procs, storage_faults

__all__ = ["STARTING_WAIT_S", "kill_after", "kill_next_start"]

STARTING_WAIT_S = 120.0  # how long the ``starting`` watcher looks for the next worker process


def kill_after(control: Path, fault_id: str, pid: int, delay_s: float) -> None:
    """SIGKILL to ``pid`` ``delay_s`` from now."""

    def kill() -> None:
        time.sleep(delay_s)
        storage_faults.log_fired(control, {"id": fault_id, "action": "kill"})
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill, name="campaign-kill", daemon=True).start()


def kill_next_start(
    control: Path, run_dir: Path, fault_id: str, *, gcs: str | None, delay_s: float,
    ready: Callable[[], set[str]],
) -> None:
    """SIGKILL to the next worker process of this run to start (forked, or started by Ray),
    ``delay_s`` after it appears, unless its worker is ``ready()`` by then (a member or a
    standby spare: too late, it never fires)."""
    known = procs.worker_processes(run_dir)

    def watch() -> None:
        end = time.monotonic() + STARTING_WAIT_S
        while time.monotonic() < end:
            new = procs.worker_processes(run_dir) - known
            if new:
                pid = min(new)
                time.sleep(delay_s)
                names = {p: n for n, p in procs.job_workers(gcs).items()}
                name = names.get(pid)
                if name in ready():
                    return  # ready already: too late (the verdict finds it never fired)
                storage_faults.log_fired(control, {"id": fault_id, "action": "kill",
                                                   "worker": name, "victim_pid": pid})
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    threading.Thread(target=watch, name="campaign-starting", daemon=True).start()
