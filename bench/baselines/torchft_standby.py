"""A warm standby for torchft: a replacement group process started ahead of need.

planaria keeps a warm spare (a process with torch imported and its model built)
that joins when a worker dies; to compare recoveries like for like, torchft's
replacement can be the same: ``torchft_train.py --standby`` imports torch and
torchft, builds the model, optimizer and dataset, runs one forward/backward, and
blocks reading one line on its stdin. :class:`Standby` keeps one such process
ready; :meth:`Standby.take` writes the killed group's id to it (it then hosts its
store and joins the lighthouse as that group's replica id) and at once starts the
next standby, as planaria starts a new spare after one is used.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable

__all__ = ["Standby"]


class Standby:
    """One standby process ready at a time.

    ``start(n)`` starts the ``n``-th standby process (stdin a pipe; ``n`` names its
    log) and returns it; ``Standby`` owns none of the processes' cleanup (the runner
    kills every process it started), only their stdin.
    """

    def __init__(self, start: Callable[[int], subprocess.Popen]) -> None:
        self._start = start
        self._started = 0
        self.ready = self._next()
        """The standby process that the next :meth:`take` hands out."""

    def _next(self) -> subprocess.Popen:
        proc = self._start(self._started)
        self._started += 1
        return proc

    def take(self, group: int) -> subprocess.Popen:
        """Tells the ready standby to join as ``group``, starts the next one, and returns
        the one told (now that group's process)."""
        used = self.ready
        assert used.stdin is not None, "a standby is started with stdin=PIPE"
        if used.poll() is not None:
            raise RuntimeError(f"the standby process exited with {used.returncode} before "
                               "it was needed (see its log)")
        used.stdin.write(f"{group}\n".encode())
        used.stdin.flush()
        used.stdin.close()
        self.ready = self._next()
        return used

    def close(self) -> None:
        """Releases the ready standby (an empty line: it exits without joining)."""
        if self.ready.stdin is not None:
            with contextlib.suppress(OSError):
                self.ready.stdin.close()
