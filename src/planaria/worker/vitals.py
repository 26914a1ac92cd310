"""What a worker tells the controller about itself: its phase, its progress, its heartbeat.

Every part of the worker reports through one :class:`Vitals`: the phase it is in
(``compute``, ``reduce``, ``send_state``, ...), a progress counter bumped at every
phase change, micro-batch, sample loaded and chunk moved, and the preemption
notice. A heartbeat thread (:func:`planaria.control.liveness.beat`) publishes them to the
controller's store; the controller judges liveness and hangs from them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from planaria.wire import store_keys
from planaria.wire.heartbeat import Heartbeat, beat, quiet_s
from planaria.worker.busy import BusyProbe

__all__ = ["Vitals"]


class Vitals:
    """A worker's phase, progress and notices, and the heartbeat thread that reports them."""

    def __init__(self, name: str, generation: Callable[[], int], heartbeat_s: float,
                 *, cpu: bool) -> None:
        """``generation()``: the generation the worker is in, for the heartbeat."""
        self.name = name
        self.generation = generation
        self.heartbeat_s = heartbeat_s
        self.phase = "starting"
        self.phase_step = -1
        self.progress = 0  # see planaria.control.liveness
        self.preempting = False
        self.committed_t = -math.inf  # when the run last applied a step
        # What the threads work on: the training thread's micro-batch ("m<j>"), the
        # loader's sample ("i<id>"), and the threads whose CPU time and frames tell busy
        # from hung (planaria.worker.busy).
        self.work = ""
        self.loading = ""
        self.train_thread: tuple[int, int] | None = None
        self.loader_thread: tuple[int, int] | None = None
        self.busy = BusyProbe(self.working_threads, cpu=cpu)
        self.quiet_s = quiet_s(heartbeat_s)
        self.stopped = threading.Event()
        self.wake = threading.Event()  # a notice: the heartbeat thread tells at once
        self.beats = 0

    def set_phase(self, phase: str, step: int) -> None:
        self.phase, self.phase_step = phase, step
        self.progress += 1

    def bytes_moved(self, n: int) -> None:
        """A chunk of a transfer or a restore moved: the progress moves."""
        self.progress += 1

    def notice_preemption(self) -> None:
        self.preempting = True
        self.wake.set()  # the controller learns of it now, not at the next step

    def quiet(self) -> bool:
        """The run committed a step just now: the stream vouches for this worker, no beat."""
        return time.monotonic() - self.committed_t < self.quiet_s

    def working_threads(self) -> list[tuple[int, int]]:
        """The threads doing this worker's work now: the training thread, and the loader
        while the training thread waits for it."""
        threads = [t for t in (self.train_thread,) if t is not None]
        if self.phase == "loading" and self.loader_thread is not None:
            threads.append(self.loader_thread)
        return threads

    def record(self, gap_s: float = 0.0) -> str:
        """The heartbeat's record (:class:`planaria.control.liveness.Heartbeat`)."""
        self.beats += 1  # changes every beat: the controller judges liveness on its own clock
        work = self.loading if self.phase == "loading" else self.work
        return Heartbeat(
            self.beats, self.phase, self.phase_step, self.generation(), self.preempting,
            self.progress, work, self.busy.sample(), int(gap_s * 1000),
        ).format()

    def start(self, store: Any, connect: Callable[[], Any]) -> None:
        """Publishes the first record on ``store`` and starts the heartbeat thread (which
        opens its own store connection with ``connect``)."""
        store.set(store_keys.heartbeat(self.name), self.record())
        threading.Thread(
            target=beat, name="planaria-heartbeat", daemon=True,
            args=(connect, self.name, self.record, self.stopped, self.heartbeat_s, self.quiet,
                  lambda: self.preempting, self.wake),
        ).start()

    def stop(self) -> None:
        self.stopped.set()
        self.wake.set()
