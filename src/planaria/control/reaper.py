"""Nothing of a job outlives it on the controller's machine, even a SIGKILLed controller.

A controller killed outright (SIGKILL, the OOM killer) leaves processes that only
time ends, if anything: measured on this machine, Ray's dashboard agent and
runtime-env agent lived ~60 s after a SIGKILLed controller, and its workers ~2 s.
So the controller starts a :class:`Reaper` before anything else: a tiny process
(:mod:`planaria.control._reaper`, the standard library alone) in a session of its own,
that waits for the controller's death and then kills the job's processes on this
machine (see :mod:`planaria.control._reaper` for which ones, and why nothing else).

The job's processes are marked: while the controller starts its own Ray session
it sets ``PLANARIA_OWNER`` (:meth:`Reaper.marking`), which every process of that
session inherits (Ray's daemons, its workers, the fork server, their children);
warm-started workers on a cluster get it through their runtime environment
(:attr:`Reaper.env`). The controller also reports the pid of every worker that
starts on this machine (:meth:`Reaper.on_event`, an event-log listener), for the
workers that carry no mark (cold starts on a cluster).

A normal close sweeps the job's processes itself (:meth:`Reaper.sweep`: what
``ray.shutdown`` left, e.g. agents whose GCS was gone) and tells the reaper to
leave (:meth:`Reaper.close`): it kills nothing then.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from planaria.control import _reaper

__all__ = ["OWNER_VAR", "Reaper"]

_log = logging.getLogger("planaria.membership")

OWNER_VAR = _reaper.OWNER_VAR
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reaper.py")
LEAVE_S = 5.0
"""How long :meth:`Reaper.close` waits for the reaper to leave before killing it."""


class Reaper:
    """The controller's side of its reaper process (one per :class:`~planaria.Job`).

    Off where there is no ``/proc`` (not Linux): every method does nothing then.
    """

    def __init__(self, events_path: Path | None = None) -> None:
        self.pid = os.getpid()
        start = _reaper.start_time(self.pid) if sys.platform.startswith("linux") else None
        # One mark per controller process, not per job: its jobs share one fork server (whose
        # address depends on the workers' PLANARIA_* variables), as they share one driver.
        self.mark = f"{self.pid}.{start}"
        self._known: dict[int, int] = {}
        self._session_dir: str | None = None
        self._host = socket.gethostname()
        self._proc: subprocess.Popen[bytes] | None = None
        if start is None:
            return
        env = {k: v for k, v in os.environ.items() if k != OWNER_VAR}
        argv = [sys.executable, "-S", "-E", SCRIPT, str(self.pid), str(start), self.mark]
        if events_path is not None:
            argv.append(str(events_path))
        try:
            # A session of its own: a SIGKILL to the controller's process group spares it.
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True, env=env,
            )
        except OSError as err:  # no reaper: a killed controller may leave processes
            _log.warning("could not start the reaper (%s): a killed controller may leave "
                         "processes behind", err)

    @property
    def reaper_pid(self) -> int | None:
        """The reaper process's pid (None: none runs)."""
        return None if self._proc is None else self._proc.pid

    @property
    def env(self) -> dict[str, str]:
        """The mark, for processes started with an environment of their own."""
        return {OWNER_VAR: self.mark}

    @contextlib.contextmanager
    def marking(self) -> Iterator[None]:
        """Marks the processes this process starts meanwhile as the job's (``ray.init``)."""
        before = os.environ.get(OWNER_VAR)
        os.environ[OWNER_VAR] = self.mark
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(OWNER_VAR, None)
            else:
                os.environ[OWNER_VAR] = before

    def watch(self, pid: int) -> None:
        """``pid`` (a process on this machine) is the job's: the reaper kills it too."""
        start = _reaper.start_time(pid)
        if start is None or pid in self._known:
            return
        self._known[pid] = start
        self._send(f"pid {pid}\n")

    def session(self, session_dir: str) -> None:
        """The job started this Ray session: its processes are the job's (Ray's agents are
        known by the session's files they hold open: their title overwrites the mark)."""
        self._session_dir = session_dir
        self._send(f"session {session_dir}\n")

    def regions(self, pattern: str) -> None:
        """Files matching the glob ``pattern`` (the job's shared-memory regions on this
        machine) are the job's: the reaper removes them once it killed its processes."""
        self._send(f"regions {pattern}\n")

    def on_event(self, record: dict[str, Any]) -> None:
        """An event-log listener: the workers that start on this machine are watched."""
        if record.get("event") != "worker_started" or record.get("node") != self._host:
            return
        for pid in [record.get("pid"), *(record.get("follower_pids") or ())]:
            if isinstance(pid, int):
                self.watch(pid)

    def sweep(self, *, session: bool, marked: bool | None = None) -> list[int]:
        """Kills the job's processes now (at close, once Ray is shut down): the reported
        workers still running and their descendants; with ``session`` (a Ray session this
        job started) its processes; with ``marked`` (default: ``session``) every process
        marked as the job's (on a cluster: the fork server, which jobs of this process
        share while its Ray lives). Returns the pids killed."""
        marked = session if marked is None else marked
        if self._proc is None and not self._known:
            return []
        exclude = {self.pid} | ({self._proc.pid} if self._proc is not None else set())
        known = {p: s for p, s in self._known.items() if _reaper.start_time(p) == s}
        killed = _reaper.sweep(self.mark if marked else None, known, exclude,
                               self._session_dir if session else None)
        if killed:
            _log.info("killed %d processes left of the job: %s", len(set(killed)),
                      sorted(set(killed)))
        return killed

    def close(self) -> None:
        """Tells the reaper to leave without killing anything, and waits for it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            assert proc.stdin is not None
            proc.stdin.write(b"exit\n")
            proc.stdin.close()
        except OSError:  # it is gone already
            pass
        try:
            proc.wait(timeout=LEAVE_S)
        except subprocess.TimeoutExpired:
            _log.warning("the reaper %d did not leave within %.0f s: killed", proc.pid, LEAVE_S)
            proc.kill()
            proc.wait(timeout=LEAVE_S)

    def _send(self, line: str) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            return
        try:
            proc.stdin.write(line.encode())
            proc.stdin.flush()
        except OSError as err:  # it died: a killed controller may leave processes
            _log.warning("the reaper %d is gone (%s)", proc.pid, err)
            self._proc = None
