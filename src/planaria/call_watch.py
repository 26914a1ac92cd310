"""Waiting on many Ray calls at O(1) cost per wait.

``ray.wait`` on N calls registers and scans all N each time it is called, so a
controller that waits in short slices (to poll between them) pays O(N) a slice
for as long as the calls run: with one long call per worker, O(N) per second of
training. Here each call gets one completion callback when the watch starts
(``ObjectRef.future()``: Ray calls back when the result, or the worker's death,
reaches this process), which puts the call on a queue; a wait takes what the
queue holds. A death is known the moment Ray reports it, whichever call it ends.
"""

from __future__ import annotations

import queue
from collections.abc import Iterable
from typing import Any

__all__ = ["CallWatch"]


class CallWatch:
    """The calls of one wait (:meth:`Job._gather <planaria.controller.Job._gather>`)."""

    def __init__(self, refs: Iterable[Any]) -> None:
        self._ended: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: dict[Any, None] = dict.fromkeys(refs)
        for ref in self._pending:
            # Ray's callback thread only queues the call: its result is read with ray.get.
            ref.future().add_done_callback(lambda _f, ref=ref: self._ended.put(ref))

    def wait(self, timeout: float) -> list[Any]:
        """The calls that ended since the last wait; blocks up to ``timeout`` s for the first."""
        ended: list[Any] = []
        try:
            ended.append(self._ended.get(timeout=max(0.0, timeout)))
            while True:
                ended.append(self._ended.get_nowait())
        except queue.Empty:
            pass
        for ref in ended:
            self._pending.pop(ref, None)
        return ended

    @property
    def pending(self) -> list[Any]:
        """The calls not ended yet, in the order given."""
        return list(self._pending)

    def __len__(self) -> int:
        return len(self._pending)
