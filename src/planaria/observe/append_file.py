"""Appending records to a file of the run directory, where a full disk is not fatal.

The run directory's writers (the event log, the ledger) append one line per
record. A disk that fills (``ENOSPC``, a quota, an I/O error) must not stop
training nor the job's cleanup: a record that cannot be written is held in
memory (up to :data:`HOLD_BYTES`), a warning is logged once per stretch of
failures, and every later record tries again, the held ones first and in order,
so a disk that frees space gets every record (the ledger, the proof that each
sample was used once, loses none). Past the hold, records are dropped and
counted, and the first record written again notes the gap (see
:attr:`AppendFile.gap`). A write that fails part-way is cut back, so the file
holds whole lines only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["HOLD_BYTES", "AppendFile"]

HOLD_BYTES = 16 << 20
"""How much an AppendFile holds in memory while its file cannot be written."""

_log = logging.getLogger("planaria.observe.events")


class AppendFile:
    """Whole lines appended to ``path``, one ``os.write`` each (nothing buffered in this
    process while the file takes writes, so a crash loses at most the line being written;
    while it does not, the records held in memory); thread-safe."""

    def __init__(self, path: str | Path, *, what: str,
                 on_gap: Callable[[int, float], None] | None = None,
                 hold_bytes: int = HOLD_BYTES) -> None:
        self.path = Path(path)
        self.what = what
        """What the file holds, for warnings ("the event log")."""
        self.on_gap = on_gap
        """Called with (records dropped, since when) after the first record written again
        after a stretch of failures: a writer notes the gap in its own format."""
        self.dropped = 0
        """Records that could not be written, over the file's life."""
        self.gap = 0
        """Records dropped since the last one written (0 while writes succeed)."""
        self.gap_since_t: float | None = None
        self.error: str | None = None
        """The last write error, while records are being held or dropped."""
        self.hold_bytes = hold_bytes
        self._held: list[bytes] = []  # records not yet written, oldest first
        self._held_size = 0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._closed = False
        self._open()

    def _open(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as err:
            self._failed(err)
            return False
        self._fd = fd
        try:
            size = os.fstat(fd).st_size
            if size and not self._ends_line(size):
                os.write(fd, b"\n")  # a crash mid-write: end the partial line
        except OSError as err:
            self._failed(err)
        return True

    def _ends_line(self, size: int) -> bool:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return os.pread(fd, 1, size - 1) == b"\n"
        finally:
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def held(self) -> int:
        """Records waiting in memory for the file to take writes again."""
        return len(self._held)

    def write_line(self, line: str) -> bool:
        """Appends ``line`` and a newline (after any records held); False if the file
        cannot take it now: the record is held in memory, or past the hold dropped and
        counted."""
        gap: tuple[int, float] | None = None
        with self._lock:
            if self._closed:
                return False
            if not self._write_held((line + "\n").encode()):
                return False
            if self.gap:
                _log.warning("%s (%s) is written again after %d records were dropped",
                             self.what, self.path, self.gap)
                gap = (self.gap, self.gap_since_t or time.time())
                self.gap, self.gap_since_t = 0, None
            self.error = None
        if gap is not None and self.on_gap is not None:
            self.on_gap(*gap)
        return True

    def _write_held(self, data: bytes | None) -> bool:
        """Writes the held records, oldest first, then ``data``; stops at the first that
        fails (one failed write per try while the disk is full, not the whole hold again)
        and holds ``data`` (or drops it past the hold). Under the lock."""
        had = len(self._held)
        while self._held:
            if not self._write_one(self._held[0]):
                return self._hold(data)
            self._held_size -= len(self._held.pop(0))
        if had:
            _log.warning("%s (%s) is written again: the %d records held meanwhile are in it",
                         self.what, self.path, had)
        if data is not None and not self._write_one(data):
            return self._hold(data)
        return True

    def _write_one(self, data: bytes) -> bool:
        """One record, whole or not at all (a write that fails part-way is cut back)."""
        if self._fd is None and not self._open():
            return False
        fd = self._fd
        assert fd is not None
        try:
            start = os.fstat(fd).st_size
        except OSError as err:
            self._failed(err)
            return False
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as err:
            with contextlib.suppress(OSError):  # the reader skips a torn line anyway
                os.ftruncate(fd, start)  # no torn line: the next record starts clean
            self._failed(err)
            return False
        return True

    def _hold(self, data: bytes | None) -> bool:
        if data is None:
            return False
        if self._held_size + len(data) > self.hold_bytes:
            return self._drop()
        self._held.append(data)
        self._held_size += len(data)
        return False

    def _drop(self) -> bool:
        self.dropped += 1
        if not self.gap:
            self.gap_since_t = time.time()
        self.gap += 1
        return False

    def _failed(self, err: OSError) -> None:
        first = self.error is None
        self.error = f"{type(err).__name__}: {err}"
        if first:
            _log.warning("cannot write %s (%s: %s); its records are held in memory (up to "
                         "%d MiB, then dropped and counted) until it can be written again: "
                         "free space there", self.what, self.path, self.error,
                         self.hold_bytes >> 20)

    def close(self) -> None:
        """Writes what is held (a last try: what still cannot be written is dropped and
        counted), then closes the file."""
        with self._lock:
            if not self._closed and self._held and not self._write_held(None):
                _log.warning("%s (%s): %d records held while it was full could not be "
                             "written before it closed: dropped", self.what, self.path,
                             len(self._held))
                for _ in self._held:
                    self._drop()
                self._held, self._held_size = [], 0
            self._closed = True
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError as err:
                _log.warning("closing %s (%s): %s", self.what, self.path, err)
