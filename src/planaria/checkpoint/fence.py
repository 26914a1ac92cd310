"""A snapshot's copy that runs beside the training: the live state must not change until
it is done.

A save's copy into staging (:class:`~planaria.checkpoint.staging.ShardImage`) reads the
live parameters and optimizer state. Between two updates nothing writes them (a
forward and backward read the parameters and write only gradients and module
buffers), so the copy can run beside the next step's compute and only the next
update has to wait for it. :class:`CopyFence` is that wait: the copying thread holds
it closed; every code that writes the live state (the optimizer's update, a restore,
a received state) calls :meth:`CopyFence.wait` first. The time a writer waited is
the save's stall on training (``blocked_s``), measured by the copying thread as it
opens the fence, so it is known before the save's record is returned.

The copy waits for a go (:meth:`CopyFence.go`) before it starts: the worker gives it when
its next step begins (or the controller asks after the save, or a writer of the state
waits), so that the copy does not compete for the cores with the save call's own reply,
which the training waits for. Past :data:`GO_AFTER_S` without one it starts anyway.
"""

from __future__ import annotations

import threading
import time

__all__ = ["GO_AFTER_S", "CopyFence"]

GO_AFTER_S = 0.1
"""The longest a closed fence's copy waits for its go (a worker left idle after a save)."""


class CopyFence:
    """Closed while a copy reads the live state; writers of the state wait at it.

    Contract: :meth:`close` is called by the thread that starts a copy, then
    :meth:`wait_go` and :meth:`open` by the copying thread, once each per copy and in that
    order; :meth:`go` by anyone, any number of times (it only lets a waiting copy start);
    :meth:`wait` by any thread that is about to write the live state: it returns at once
    while no copy runs, and gives the go itself. A copy that fails still opens the fence
    (the copier's ``finally``).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self._waiting_since: float | None = None
        #: Seconds a writer waited for the last copy (0.0 when none had to).
        self.blocked_s = 0.0
        #: Seconds the last copy took.
        self.copy_s = 0.0
        self._copy_began = 0.0
        self._go = True

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def waiting(self) -> bool:
        """A writer of the state waits at the fence now."""
        return self._waiting_since is not None

    def close(self) -> None:
        """A copy begins: writers wait from now on."""
        with self._cond:
            self._closed = True
            self._go = False
            self._waiting_since = None
            self.blocked_s = 0.0

    def go(self) -> None:
        """Lets a closed fence's copy start (the step after the save begins)."""
        with self._cond:
            if not self._go:
                self._go = True
                self._cond.notify_all()

    def wait_go(self, timeout_s: float | None = None) -> None:
        """The copying thread: returns once the copy may start (a go, or ``timeout_s``,
        :data:`GO_AFTER_S` by default); the copy's time (:attr:`copy_s`) counts from here."""
        with self._cond:
            self._cond.wait_for(lambda: self._go,
                                GO_AFTER_S if timeout_s is None else timeout_s)
            self._go = True
            self._copy_began = time.perf_counter()

    def open(self) -> None:
        """The copy ended (or failed): waiting writers go on, and what they waited is
        recorded in :attr:`blocked_s`."""
        with self._cond:
            now = time.perf_counter()
            self.copy_s = now - self._copy_began
            if self._waiting_since is not None:
                self.blocked_s = now - self._waiting_since
            self._closed = False
            self._waiting_since = None
            self._cond.notify_all()

    def wait(self) -> None:
        """Returns once no copy reads the live state (at once if none does)."""
        with self._cond:
            if not self._closed:
                return
            self.go()  # the copy may not have started: the writer's wait starts it
            if self._waiting_since is None:
                self._waiting_since = time.perf_counter()
            while self._closed:
                self._cond.wait()
