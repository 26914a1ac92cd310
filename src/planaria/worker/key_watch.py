"""Store keys a worker waits to see, polled from a background thread.

Rank 0 of a run learns from the controller's store, in the middle of its steps,
that the controller wants a boundary (``stop/<gen>/<run>``; one reader, so the
store's load does not grow with the width; an abort is pushed to every worker
instead, see :meth:`Worker.abort <planaria.worker.Worker.abort>`). Reading it
on the training thread costs a round trip each time, and on a machine whose
cores the workers keep busy the round trip waits for the controller's store
thread to be scheduled: milliseconds a step on the critical path.
:class:`KeyWatch` polls it from its own thread, with its
own store connection, only while a step is in progress (:meth:`busy`); the
training thread reads a flag.

Keys are never reused (every generation and every run has its own), so a key
once seen stays seen.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["KeyWatch"]


class KeyWatch:
    """Polls watched store keys in a daemon thread while the owner is busy."""

    def __init__(self, connect: Callable[[], Any], *, name: str = "planaria-key-watch") -> None:
        self._connect = connect
        self._periods: dict[str, float] = {}  # key -> how often to look
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._busy = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def watch(self, key: str, period_s: float) -> None:
        """Looks for ``key`` at most every ``period_s`` while busy."""
        with self._lock:
            self._periods[key] = period_s

    def forget(self, prefix: str) -> None:
        """Stops looking for the keys that start with ``prefix``."""
        with self._lock:
            for key in [k for k in self._periods if k.startswith(prefix)]:
                del self._periods[key]
            self._seen = {k for k in self._seen if not k.startswith(prefix)}

    def seen(self, key: str) -> bool:
        """Whether ``key`` was found in the store (no round trip)."""
        return key in self._seen

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """The keys are polled while this block runs (a step), not between."""
        self._busy.set()
        try:
            yield
        finally:
            self._busy.clear()

    def close(self) -> None:
        self._stop.set()
        self._busy.set()  # wakes the thread to see the stop

    def _loop(self) -> None:
        store = None
        last: dict[str, float] = {}
        while not self._stop.is_set():
            self._busy.wait()
            with self._lock:
                due = [(k, p) for k, p in self._periods.items() if k not in self._seen]
            last = {k: t for k, t in last.items() if k in self._periods}  # forgotten: gone
            now = time.monotonic()
            for key, period in due:
                if now - last.get(key, 0.0) < period:
                    continue
                last[key] = now
                try:
                    if store is None:
                        store = self._connect()
                    if store.check([key]):
                        with self._lock:
                            if key in self._periods:
                                self._seen.add(key)
                except Exception:  # the controller's store is gone or slow: look again later
                    store = None
            wait = min((p for _, p in due), default=0.05)
            self._stop.wait(wait)
