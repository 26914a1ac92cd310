"""Is a worker's training thread doing something, though its progress counter stands still?

A heavy micro-batch (a long sequence) or a slow ``dataset[i]`` can keep a worker's
training thread inside one call for many times a typical step, with no micro-batch
finished and so no progress. That worker is busy, not hung, and must not be killed
as hung. Its heartbeat thread tells the two apart, once a beat
(:class:`BusyProbe`):

- on a CPU worker, by the CPU time of the threads doing the work (the training
  thread, and the loader thread while the training thread waits for it), read from
  ``/proc/self/task/<tid>/stat``: a thread that computes accumulates CPU time, one
  blocked on a lock, a socket or a sleep does not;
- on a GPU worker, where a thread waiting for a kernel may spin (CPU time without
  progress), by its CPU time *and* its innermost Python frame moving: a forward pass
  runs from line to line, a thread stuck in one synchronisation does not.

A thread that spins in Python waiting for something (a polling loop) may read as busy
on a GPU worker; a blocking wait never does. Where ``/proc`` is missing (not Linux),
the frames alone are read.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

__all__ = ["BusyProbe", "current_thread_ids", "thread_cpu_ticks"]


def thread_cpu_ticks(native_id: int) -> int | None:
    """User plus system CPU time of thread ``native_id`` of this process, in clock ticks
    (None where it cannot be read)."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: fields follow the last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    except (IndexError, ValueError):
        return None


class BusyProbe:
    """Counts the beats at which the working threads were doing something (see the module).

    ``threads()`` names the threads to look at now, as ``(ident, native_id)`` pairs
    (``threading.get_ident()``, ``threading.get_native_id()``); ``cpu`` says the worker
    computes on the CPU, so CPU time alone is evidence of work.
    """

    def __init__(self, threads: Callable[[], list[tuple[int, int]]], *, cpu: bool) -> None:
        self._threads = threads
        self._cpu = cpu
        self._last: dict[int, tuple[int | None, object]] = {}
        self.count = 0
        """Beats at which some working thread moved; the heartbeat carries it."""

    def sample(self) -> int:
        """Looks at the working threads once; returns :attr:`count` (bumped if one moved)."""
        frames = sys._current_frames()
        moved = False
        now: dict[int, tuple[int | None, object]] = {}
        for ident, native in self._threads():
            frame = frames.get(ident)
            where = None if frame is None else (id(frame.f_code), frame.f_lineno)
            ticks = thread_cpu_ticks(native) if native else None
            now[ident] = (ticks, where)
            before = self._last.get(ident)
            if before is None:
                continue
            cpu_moved = ticks is not None and before[0] is not None and ticks > before[0]
            frame_moved = where != before[1]
            if ticks is None:  # no /proc: frames are all there is
                moved |= frame_moved
            elif self._cpu:
                moved |= cpu_moved
            else:
                moved |= cpu_moved and frame_moved
        self._last = now
        if moved:
            self.count += 1
        return self.count


def current_thread_ids() -> tuple[int, int]:
    """``(ident, native_id)`` of the calling thread."""
    return threading.get_ident(), threading.get_native_id()

