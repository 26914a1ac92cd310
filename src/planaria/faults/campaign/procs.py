"""The processes of one job: its workers (followers too), its Ray GCS and raylet, its leftovers.

Every process a campaign job starts inherits ``PLANARIA_CAMPAIGN_RUN=<run dir>`` in its
environment (the controller has it; Ray's own processes and the workers inherit it
from there), so a run's processes are told from another run's (parallel runs share
the machine) and from anything else on it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["INCARNATION", "RUN_MARKER", "job_workers", "marked", "ray_children",
           "worker_processes"]

RUN_MARKER = "PLANARIA_CAMPAIGN_RUN"
INCARNATION = "PLANARIA_CAMPAIGN_INCARNATION"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and parentheses


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def job_workers(gcs_address: str | None) -> dict[str, int]:
    """Name -> pid of the planaria workers of the Ray instance at ``gcs_address`` alive on
    this machine (a sharded replica's followers ``w3.1`` too), from their markers."""
    from planaria.wire.worker_markers import live_workers

    return {m.name: m.pid for m in live_workers() if m.gcs_address == gcs_address}


def ray_children(parent: int, binary: str) -> list[int]:
    """The children of ``parent`` running Ray's ``binary`` (``gcs_server``, ``raylet``): the
    Ray processes a controller started for its own local instance, never another job's."""
    out = []
    for pid in _pids():
        if _ppid(pid) != parent:
            continue
        argv0 = _cmdline(pid).split(" ", 1)[0]
        if Path(argv0).name == binary:
            out.append(pid)
    return sorted(out)


def worker_processes(run_dir: str | Path) -> set[int]:
    """The run's Ray worker processes, from their first moment: the children of its fork
    servers (a warm start) and the processes its raylet starts cold (Ray's
    ``default_worker.py``, before Ray retitles them; not the fork server's launchers, which
    stand for a forked worker)."""
    mine = {pid: _cmdline(pid) for pid in _marked_pids(run_dir)}
    servers = {pid for pid, cmd in mine.items() if "planaria/worker/forkserver.py" in cmd}
    raylets = {pid for pid, cmd in mine.items() if Path(cmd.split(" ", 1)[0]).name == "raylet"}
    out = set()
    for pid, cmd in mine.items():
        parent = _ppid(pid)
        if parent in servers or (parent in raylets and "default_worker.py" in cmd
                                 and "_forkserver_launch" not in cmd):
            out.add(pid)
    return out


def _marked_pids(run_dir: str | Path) -> list[int]:
    marker = f"{RUN_MARKER}={Path(run_dir).resolve()}".encode()
    out = []
    for pid in _pids():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            if marker in f.read().split(b"\0"):
                out.append(pid)
    return out


def marked(run_dir: str | Path) -> dict[int, str]:
    """pid -> ``incarnation N: command line`` of every live process started for the run at
    ``run_dir`` (N: the job's incarnation that started it)."""
    marker = f"{RUN_MARKER}={Path(run_dir).resolve()}".encode()
    prefix = f"{INCARNATION}=".encode()
    out = {}
    for pid in _pids():
        if pid == os.getpid():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            if marker not in env:
                continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # a zombie: gone, its parent has not reaped it yet
            inc = next((e[len(prefix):].decode() for e in env if e.startswith(prefix)), "?")
            out[pid] = f"incarnation {inc}: {_cmdline(pid)[:200]}"
    return out
