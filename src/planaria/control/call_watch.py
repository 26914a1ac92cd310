"""Waiting on many Ray calls at O(1) cost per wait.

``ray.wait`` on N calls registers and scans all N each time it is called, so a
controller that waits in short slices (to poll between them) pays O(N) a slice
for as long as the calls run: with one long call per worker, O(N) per second of
training. Here each call gets one completion callback when the watch starts
(``ObjectRef.future()``: Ray calls back when the result, or the worker's death,
reaches this process), which puts the call on a queue; a wait takes what the
queue holds. A death is known the moment Ray reports it, whichever call it ends.
Ray's callback thread has deserialized the result by then (the future holds it):
:meth:`CallWatch.result` takes it from there, so a large result (a whole state,
``Job.state()``) is not deserialized a second time by ``ray.get``.

The callbacks are the fast path, not the only one: :meth:`CallWatch.recheck` asks
Ray directly (one ``ray.wait`` over the calls still pending), which the
controller does when no call has ended for a while, so a completion whose
callback never came costs seconds, not the call's whole deadline. A call the
recheck finds whose callback is still deserializing its result (a whole state takes
seconds) is taken from the callback's future once that is done, not deserialized a
second time beside it (twice the memory, and the time).

A worker's death is known sooner still from its lifeline (:mod:`planaria.wire.lifeline`):
given the lifelines (``exits``) and the workers' names, the watch ends a call the moment
its worker's process ends, with :class:`~planaria.faults.errors.WorkerExited` as its error
(unless its result had come already); Ray's notice of it, later, is ignored.
"""

from __future__ import annotations

import concurrent.futures
import queue
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import ray

from planaria.faults import points
from planaria.faults.errors import WorkerExited, is_death
from planaria.wire.lifeline import ExitWatcher

__all__ = ["RESULT_WAIT_S", "CallWatch", "Exits"]

RESULT_WAIT_S = 10.0
"""How long :meth:`CallWatch.result` waits for a callback's future still deserializing the
result of a call Ray says has ended, before it asks Ray for the result itself."""


class Exits(Protocol):
    """Where deaths are known before Ray's notice (:class:`planaria.wire.lifeline.Lifelines`):
    :meth:`watch` tells ``watcher`` of each of ``names`` whose process has ended (at once
    for those ended already, then as they end, from any thread) until :meth:`unwatch`."""

    def watch(self, watcher: ExitWatcher, names: list[str]) -> None: ...

    def unwatch(self, watcher: ExitWatcher) -> None: ...


class CallWatch:
    """The calls of one wait (:meth:`Calls.gather <planaria.control.calls.Calls.gather>`).
    Their completion notices pass the fault point ``calls.notice``, which can drop them.

    ``refs``: the calls, or {call: worker name} with ``exits`` (a call ends when its
    worker's process does); :meth:`close` stops hearing of exits."""

    def __init__(self, refs: Iterable[Any] | Mapping[Any, str], *,
                 exits: Exits | None = None) -> None:
        self._ended = queue.SimpleQueue[Any]()  # Ray's callback thread puts, the waiter takes
        self._pending: dict[Any, None] = dict.fromkeys(refs)
        self._futures: dict[Any, Any] = {}
        self._exited: dict[Any, str] = {}  # calls whose worker's lifeline ended
        for ref in self._pending:
            # Ray's callback thread only queues the call; the future keeps its result.
            self._futures[ref] = future = ref.future()
            future.add_done_callback(lambda f, ref=ref: self._notice(ref, f))
        self._exits = exits
        self._by_name: dict[str, Any] = {}
        if exits is not None:
            assert isinstance(refs, Mapping), "exits needs the workers' names: {call: name}"
            self._by_name = {name: ref for ref, name in refs.items()}
            exits.watch(self, list(self._by_name))

    def process_ended(self, name: str) -> None:
        """``name``'s process ended (its lifeline's thread): its call ends now, as a death."""
        ref = self._by_name.get(name)
        if ref is not None and ref not in self._exited:
            self._exited[ref] = name
            self._ended.put(ref)

    def close(self) -> None:
        """Stops hearing of exits (the wait is over)."""
        if self._exits is not None:
            self._exits.unwatch(self)
            self._exits = None

    def _notice(self, ref: Any, future: Any) -> None:
        """Ray's notice that ``ref`` ended (on its callback thread): queued, unless the
        fault point ``calls.notice`` drops it."""
        if points.hit("calls.notice", ref=ref, future=future) is not points.SKIP:
            self._ended.put(ref)

    def wait(self, timeout: float) -> list[Any]:
        """The calls that ended since the last wait; blocks up to ``timeout`` s for the first."""
        ended: list[Any] = []
        try:
            ended.append(self._ended.get(timeout=max(0.0, timeout)))
            while True:
                ended.append(self._ended.get_nowait())
        except queue.Empty:
            pass
        return self._take(ended)

    def result(self, ref: Any) -> Any:
        """The result of the call ``ref`` that ended (raises its error, as ``ray.get``
        would): the one Ray's callback deserialized, waiting up to :data:`RESULT_WAIT_S` for
        a callback still at it (a call found by :meth:`recheck`), else ``ray.get``'s. Once
        per call: the watch lets go of the result. A call whose worker's process ended
        raises WorkerExited, unless Ray holds its result already (it answered, then died)."""
        future = self._futures.pop(ref, None)
        name = self._exited.get(ref)
        if name is not None:
            return self._after_exit(ref, name, future)
        if future is not None:
            concurrent.futures.wait([future], timeout=RESULT_WAIT_S)
            if future.done():
                return future.result()
        return ray.get(ref)

    def _after_exit(self, ref: Any, name: str, future: Any) -> Any:
        """A call whose worker's process ended: what it answered if Ray holds that already
        (it answered, then died), else WorkerExited (also where Ray's word, come meanwhile,
        is the death: one error for one death, whichever source was first)."""
        err: BaseException | None = None
        if future is not None and future.done():
            err = future.exception()
            if err is None:
                return future.result()
        elif ray.wait([ref], timeout=0)[0]:
            try:
                return ray.get(ref)
            except Exception as raised:
                err = raised
        if err is not None and not is_death(err):
            raise err
        raise WorkerExited(f"worker {name}'s process ended (its lifeline to the controller "
                           "closed) before it answered")

    def recheck(self) -> list[Any]:
        """The pending calls Ray says have ended (a ``ray.wait`` that does not block), taken
        off the watch as :meth:`wait` would; for each, its callback had not come."""
        if not self._pending:
            return []
        refs = list(self._pending)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return self._take(done)

    def _take(self, refs: list[Any]) -> list[Any]:
        """Of ``refs``, those still pending, taken off the watch: each call ends once (not
        again when its callback comes after a recheck took it, nor after a drop)."""
        return [r for r in refs if self._pending.pop(r, False) is None]

    def drop(self, refs: Iterable[Any]) -> None:
        """Stops waiting on ``refs`` (calls to workers the controller killed: their end is
        known). A callback that comes later is ignored."""
        for ref in refs:
            self._pending.pop(ref, None)
            self._futures.pop(ref, None)

    @property
    def pending(self) -> list[Any]:
        """The calls not ended yet, in the order given."""
        return list(self._pending)

    def __len__(self) -> int:
        return len(self._pending)
