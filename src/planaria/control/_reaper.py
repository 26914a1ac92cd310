"""The reaper: a tiny process that outlives its controller and ends the job's processes.

The controller starts it (:class:`planaria.control.reaper.Reaper`) as
``<python> -S -E <this file> <controller pid> <its start time> <owner mark> <event log>``, in a
session of its own (a SIGKILL to the controller's process group spares it). It
imports the standard library alone (it costs ~20 ms and a few MB). It waits for
one of two things:

- ``exit`` on its standard input: the controller closed normally (and ended its
  processes itself); the reaper leaves, killing nothing.
- the controller's death (a pidfd that becomes readable; where there is none, its
  pid polled with its start time): the reaper kills the job's processes on this
  machine, removes the files the controller named (``regions <glob pattern>`` lines: the
  workers' shared-memory regions, planaria.worker.memory_reserve, which no one else
  would remove before the node restarts), appends a ``reaped`` record to the run's
  event log (its writer is dead; an error of the reaper's own goes to ``reaper.log``
  beside it), then leaves.

The job's processes are those whose environment carries ``PLANARIA_OWNER=<mark>``
(the controller sets it while it starts its own Ray session, so Ray's daemons, the
workers they start, the fork server and whatever those start inherit it; warm
workers on a cluster get it through their runtime environment), Ray's processes
holding files of the job's own Ray session open (``session <dir>``: Ray's agents,
whose title overwrites their environment), the pids the controller reported
(``pid <pid>`` lines: workers on this machine, checked by their start time so that
a reused pid is never killed), and every descendant of these. The controller and
the reaper themselves are never killed; nothing else is matched, so other Ray
instances and other jobs on the machine are left alone.

A kill sweep repeats until two scans in a row find nothing (a raylet may start a
worker while it is being killed), for at most :data:`SWEEP_S`.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import select
import signal
import sys
import time
from dataclasses import dataclass, field

OWNER_VAR = "PLANARIA_OWNER"
SWEEP_S = 20.0
"""The longest a sweep keeps killing (processes that keep appearing, a D-state one)."""
POLL_S = 0.2
"""How often the controller's pid is checked where there is no pidfd."""


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):  # exited, not reaped yet: nothing runs
        return None
    return int(fields[19])


def _scan() -> dict[int, tuple[int, int]]:
    """Every live process: pid -> (parent pid, start time)."""
    out: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        if fields[0] in (b"Z", b"X"):
            continue
        out[int(name)] = (int(fields[1]), int(fields[19]))
    return out


def _marked(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in b"\0" + f.read()
    except OSError:  # gone, or not ours to read (another user's: not the job's)
        return False


def _ray_process_of(pid: int, session_dir: str) -> bool:
    """A Ray process (``ray::`` title) with a file of ``session_dir`` open (its logs)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if not f.read(5).startswith(b"ray::"):
                return False
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    prefix = session_dir.rstrip("/") + "/"
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                return True
    return False


def job_processes(mark: str | None, known: dict[int, int], exclude: set[int],
                  session_dir: str | None = None) -> list[int]:
    """The live processes of the job marked ``mark`` on this machine: marked in their
    environment (not looked for with None), Ray's processes of the job's own session
    ``session_dir`` (Ray's agents rewrite their environment with their title: they are
    known by the session's log files they hold open), the processes in ``known``
    (pid -> start time), and the descendants of all these; never one in ``exclude``."""
    procs = _scan()
    needle = None if mark is None else f"\0{OWNER_VAR}={mark}\0".encode()
    found = {pid for pid, (_, start) in procs.items()
             if known.get(pid) == start or (needle is not None and _marked(pid, needle))
             or (session_dir is not None and _ray_process_of(pid, session_dir))}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return sorted(found - exclude)


def sweep(mark: str | None, known: dict[int, int], exclude: set[int],
          session_dir: str | None = None, timeout_s: float = SWEEP_S) -> list[int]:
    """SIGKILLs the job's processes until two scans in a row find none (or ``timeout_s``
    has passed); returns the pids killed."""
    killed: list[int] = []
    quiet = 0
    end = time.monotonic() + timeout_s
    while quiet < 2 and time.monotonic() < end:
        targets = job_processes(mark, known, exclude, session_dir)
        if not targets:
            quiet += 1
            time.sleep(0.05)
            continue
        quiet = 0
        for pid in targets:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.05)
    return killed


@dataclass
class _Reported:
    """What the controller told its reaper."""

    known: dict[int, int] = field(default_factory=dict)  # pid -> start time
    session_dir: str | None = None  # of the Ray session the job started
    regions: list[str] = field(default_factory=list)  # glob patterns of files to remove


def _wait_for_death(pid: int, start: int, commands: int) -> tuple[bool, _Reported]:
    """Reads ``commands`` (the controller's pipe) until ``exit`` (-> False) or the
    controller's death (-> True); returns that and what it reported."""
    told = _Reported()
    known = told.known
    pidfd: int | None = None
    with contextlib.suppress(AttributeError, OSError):
        pidfd = os.pidfd_open(pid)
    if start_time(pid) != start:  # gone already (or the pid is someone else's now)
        return True, told
    buffer = b""
    watched = [commands] + ([pidfd] if pidfd is not None else [])
    while True:
        readable, _, _ = select.select(watched, [], [], None if pidfd is not None else POLL_S)
        if pidfd in readable or start_time(pid) != start:
            return True, told
        if commands not in readable:
            continue
        chunk = os.read(commands, 4096)
        if not chunk:  # the controller closed its end: its exit follows (or it lives on)
            watched.remove(commands)
            if not watched:  # no pidfd: poll
                while start_time(pid) == start:
                    time.sleep(POLL_S)
                return True, told
            continue
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"session "):
                told.session_dir = line[len(b"session "):].decode()
                continue
            if line.startswith(b"regions "):
                told.regions.append(line[len(b"regions "):].decode())
                continue
            parts = line.split()
            if parts == [b"exit"]:
                return False, told
            if len(parts) == 2 and parts[0] == b"pid" and parts[1].isdigit():
                reported = int(parts[1])
                started = start_time(reported)
                if started is not None:
                    known[reported] = started


def remove_regions(patterns: list[str]) -> int:
    """Removes the files matching ``patterns`` (the dead job's shared-memory regions: its
    processes, which held them, are killed); returns how many."""
    removed = 0
    for pattern in patterns:
        for path in glob.glob(pattern):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
    return removed


def _record(events: str, **fields: object) -> None:
    """Appends one record to the run's event log (its writer is dead: no one else writes)."""
    line = json.dumps({"t": time.time(), **fields}, separators=(",", ":"))
    with contextlib.suppress(OSError), open(events, "ab+") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":  # the controller died mid-line: end it
                f.write(b"\n")
        f.write(line.encode() + b"\n")


def main(argv: list[str]) -> int:
    controller, start, mark = int(argv[0]), int(argv[1]), argv[2]
    events = argv[3] if len(argv) > 3 else None
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)  # a terminal's signals are the controller's
    died, told = _wait_for_death(controller, start, sys.stdin.fileno())
    if not died:
        return 0
    t0 = time.monotonic()
    killed = sweep(mark, told.known, {os.getpid(), controller}, told.session_dir)
    pids = sorted(set(killed))
    regions = remove_regions(told.regions)
    sweep_s = round(time.monotonic() - t0, 3)
    if events:
        _record(events, event="reaped", controller=controller, killed=pids, sweep_s=sweep_s,
                regions_removed=regions)
    return 0


if __name__ == "__main__":
    # Run as a file: its own directory (planaria's modules) must not shadow top-level names.
    sys.path.pop(0)
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception:  # said beside the run's event log: no one else would see it
        if len(sys.argv) > 4:
            import traceback

            with contextlib.suppress(OSError), open(
                os.path.join(os.path.dirname(sys.argv[4]), "reaper.log"), "a"
            ) as log:
                traceback.print_exc(file=log)
        raise
