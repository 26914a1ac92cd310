"""The planaria workers on this machine, found through markers: each worker leaves a file
named after its pid in :func:`worker_dir` (``$PLANARIA_WORKER_DIR``, default
``<tmp>/planaria-workers``) holding its process start time (to tell a reused pid apart),
name, Ray node id and GCS address. The node hook (:mod:`planaria.control.drain`) reads them
to forward a node's SIGTERM; a worker's loader reads them to count its node's workers."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["WORKER_DIR_ENV", "WorkerMarker", "live_workers", "register_worker", "worker_dir"]

_log = logging.getLogger("planaria.membership")

WORKER_DIR_ENV = "PLANARIA_WORKER_DIR"


def worker_dir() -> Path:
    """Where the workers on this machine leave their markers."""
    return Path(os.environ.get(WORKER_DIR_ENV) or Path(tempfile.gettempdir()) / "planaria-workers")


@dataclass(frozen=True)
class WorkerMarker:
    """A planaria worker process on this machine, as its marker describes it."""

    pid: int
    start: str
    name: str
    node_id: str | None
    gcs_address: str | None

    def alive(self) -> bool:
        """The marker's process still runs (its pid does not name another process now)."""
        return _start_time(self.pid) == self.start


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None when
    it has exited: with the pid, it names one process (a pid is reused, a (pid, start) pair
    is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the fields after "(comm)": state is field 3
    if fields[0] in ("Z", "X"):  # exited, not yet reaped by its parent: gone all the same
        return None
    return fields[19]


def register_worker(name: str, *, node_id: str | None, gcs_address: str | None) -> Path | None:
    """Leaves this process's marker in :func:`worker_dir` (best effort: None if it cannot)
    and removes the markers of processes that are gone."""
    pid = os.getpid()
    start = _start_time(pid)
    if start is None:  # no /proc: not Linux; the node hook cannot find workers here
        return None
    folder = worker_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        live_workers(folder)  # prunes the stale ones
        path = folder / str(pid)
        tmp = folder / f".{pid}.tmp"
        tmp.write_text(json.dumps({"start": start, "name": name, "node_id": node_id,
                                   "gcs_address": gcs_address}))
        os.replace(tmp, path)
        return path
    except OSError as err:
        _log.debug("could not leave a worker marker in %s: %r", folder, err)
        return None


def live_workers(folder: Path | None = None) -> list[WorkerMarker]:
    """The planaria workers alive on this machine; markers of dead processes are removed."""
    folder = worker_dir() if folder is None else folder
    found: list[WorkerMarker] = []
    if not folder.is_dir():
        return found
    for path in folder.iterdir():
        if not path.name.isdigit():
            continue
        pid = int(path.name)
        try:
            record: dict[str, str | None] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written; or not ours
        if _start_time(pid) != record.get("start"):  # gone, or the pid now names another
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        found.append(WorkerMarker(pid, str(record["start"]), str(record.get("name")),
                                  record.get("node_id"), record.get("gcs_address")))
    return sorted(found, key=lambda m: m.pid)
