"""A worker's death, known the moment its process ends: one TCP connection per worker.

Each worker process connects once to the controller's :class:`Lifelines` and sends its
name; it never writes again and never closes the connection. When the process ends,
however it ends (SIGKILL, the OOM killer, a segfault, ``os._exit``), its kernel closes
the connection, and the controller's thread sees the end of the stream within a
millisecond or so. Ray's own notice of an actor's death travels raylet → GCS → the
controller's core worker: 17 to 33 ms after a SIGKILL on an idle 2-core machine, ~80 ms
when the replicas keep those cores busy (medium model, 3 replicas).

What an ended lifeline says: the worker's process is gone (or its connection was reset,
which the controller treats the same way: the worker is evicted and fenced, so a live one
taken for dead is killed, never left running beside its replacement). What it cannot say:
a node that lost power or a link that drops packets closes nothing; heartbeats and Ray's
notices find those, as before.

A process the worker forks (a data loader's workers) closes its copy of the connection
at once (:func:`os.register_at_fork`), or a SIGKILLed worker's children would keep it
open. A worker that cannot reach the controller's listener (a firewall between nodes)
goes on without one: its deaths are then known from Ray's notices, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
import weakref
from typing import Protocol

__all__ = ["ExitWatcher", "Lifelines", "hold"]

_log = logging.getLogger("planaria.wire.lifeline")

HELLO_MAX = 256  # bytes of a worker's name line: more is not a worker
CONNECT_TIMEOUT_S = 5.0


class ExitWatcher(Protocol):
    """Told of each worker whose lifeline ended (on the lifelines' thread: it must not
    block)."""

    def process_ended(self, name: str) -> None: ...


class Lifelines:
    """The controller's listener (see the module doc), on ``host`` (the store's address),
    served by one daemon thread.

    :meth:`watch` registers a watcher (held weakly: one that is dropped stops hearing);
    it is told at once of the names whose lifeline has ended already. A worker that
    connects under the name of one whose lifeline ended (a start retried under the same
    name) is that name's lifeline from then on: the older one's end is not reported."""

    def __init__(self, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(256)
        self._sock.setblocking(False)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._lock = threading.Lock()
        self._current: dict[str, socket.socket] = {}  # name -> its newest lifeline
        self._ended: dict[str, float] = {}  # name -> when its lifeline ended
        self._watchers: weakref.WeakSet[ExitWatcher] = weakref.WeakSet()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()  # ends the thread on close
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="planaria-lifelines",
                                        daemon=True)
        self._thread.start()

    def watch(self, watcher: ExitWatcher, names: list[str]) -> None:
        """From now on ``watcher`` hears of ended lifelines; of ``names``, those ended
        already are told at once (here, on the caller's thread)."""
        with self._lock:
            self._watchers.add(watcher)
            gone = [n for n in names if n in self._ended]
        for name in gone:
            watcher.process_ended(name)

    def unwatch(self, watcher: ExitWatcher) -> None:
        with self._lock:
            self._watchers.discard(watcher)

    def ended_at(self, name: str) -> float | None:
        """When ``name``'s lifeline ended (Unix time), or None: connected, or never was."""
        with self._lock:
            return self._ended.get(name)

    def connected(self, name: str) -> bool:
        with self._lock:
            return name in self._current

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5.0)

    # ---- the thread --------------------------------------------------------------------------

    def _serve(self) -> None:
        hello: dict[socket.socket, bytes] = {}  # connected, name not read in full yet
        names: dict[socket.socket, str] = {}
        try:
            while not self._closed:
                for key, _ in self._selector.select():
                    if key.data == "wake":
                        return
                    if key.fileobj is self._sock:
                        self._accept(hello)
                        continue
                    conn = key.fileobj
                    assert isinstance(conn, socket.socket)
                    try:
                        data = conn.recv(HELLO_MAX)
                    except OSError:  # a reset: the same as an end
                        data = b""
                    if conn in names:
                        if not data:
                            self._end(conn, names.pop(conn))
                        continue  # a worker never writes after its name; ignored
                    buf = hello.get(conn, b"") + data
                    if not data or len(buf) > HELLO_MAX:
                        hello.pop(conn, None)  # not a worker (or gone before its name)
                        self._drop(conn)
                    elif b"\n" in buf:
                        hello.pop(conn, None)
                        name = buf.split(b"\n", 1)[0].decode(errors="replace")
                        names[conn] = name
                        self._connect(conn, name)
                    else:
                        hello[conn] = buf
        finally:
            for conn in [*hello, *names]:
                self._drop(conn)
            for s in (self._sock, self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    s.close()
            with contextlib.suppress(Exception):
                self._selector.close()

    def _accept(self, hello: dict[socket.socket, bytes]) -> None:
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            _log.debug("lifeline accept failed", exc_info=True)
            return
        conn.setblocking(False)
        hello[conn] = b""
        self._selector.register(conn, selectors.EVENT_READ, None)

    def _connect(self, conn: socket.socket, name: str) -> None:
        with self._lock:
            self._current[name] = conn
            self._ended.pop(name, None)

    def _end(self, conn: socket.socket, name: str) -> None:
        self._drop(conn)
        with self._lock:
            if self._current.get(name) is not conn:
                return  # a newer start under this name holds the lifeline now
            del self._current[name]
            self._ended[name] = time.time()
            watchers = list(self._watchers)
        _log.debug("%s's lifeline ended", name)
        for watcher in watchers:
            try:
                watcher.process_ended(name)
            except Exception:  # one watcher's bug must not end the thread
                _log.exception("a lifeline watcher failed")

    def _drop(self, conn: socket.socket) -> None:
        with contextlib.suppress(Exception):
            self._selector.unregister(conn)
        with contextlib.suppress(OSError):
            conn.close()


_held: list[socket.socket] = []
_fork_hook = False


def _close_in_child() -> None:
    """In a process this one forked: the lifelines are the parent's, not the child's."""
    for sock in _held:
        with contextlib.suppress(OSError):
            sock.close()
    _held.clear()


def hold(address: str, name: str) -> socket.socket | None:
    """Connects this process's lifeline to the controller's :class:`Lifelines` at
    ``host:port`` under ``name`` and keeps it for the life of the process; None (logged)
    when the listener cannot be reached."""
    global _fork_hook
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        sock.sendall(name.encode() + b"\n")
    except (OSError, ValueError) as err:
        _log.warning("%s could not connect its lifeline to the controller at %s (%s): its "
                     "death will be known from Ray's notice alone", name, address, err)
        return None
    if not _fork_hook:
        os.register_at_fork(after_in_child=_close_in_child)
        _fork_hook = True
    _held.append(sock)
    return sock
