"""The lease on a checkpoint root: one controller writes a root at a time, and the root
remembers the lineage of runs that wrote it.

``LEASE.json`` at the root names the holder (a run id, and the process: host, pid,
the host's boot id, the pid namespace and the process's start time), an ``epoch``
that grows by one at each acquisition (the fencing token: a commit checks it is
still the holder's before it writes the marker), when the lease expires unless
renewed, its ``ttl_s``, and the holder's lineage (the run ids whose checkpoints
it continues, oldest first). The holder renews it every ``ttl_s / 3`` from a
background thread (:meth:`RootLease.start_heartbeat`), whatever the job is doing.

A new controller takes the lease when it is free: expired, released, or held by
a process that is known to be gone. Known where the holder ran on this machine
and in this pid namespace (same host name, boot id and namespace): its pid no
longer runs, or runs a process started at another time (a pid reused, as by a
controller restarted in place with the same pid). Elsewhere (another host, a
container restarted into a new pid namespace) nothing can be checked, so the new
controller watches the lease: renewed within the time it has left (at most its
``ttl_s``) means a live holder (:class:`LeaseHeld`); not renewed, it is taken.

Acquisition is read, write, read back: on storage without conditional writes two
controllers starting within the same instant may both pass it; the epoch check
at every commit then stops the one that lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from planaria.checkpoint.errors import LeaseHeld
from planaria.checkpoint.storage import Storage

__all__ = ["LEASE", "LeaseState", "ProcessIdentity", "RootLease", "process_start"]

LEASE = "LEASE.json"
WATCH_POLL_S = 1.0
"""While watching a lease it cannot check, a controller reads it this often (at most)."""

_log = logging.getLogger("planaria.checkpoint")


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``'s 22nd
    field); None where that cannot be read (no such process, no /proc)."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text:
        return None
    try:
        return int(text.rsplit(")", 1)[1].split()[19])  # fields after "(comm)" start at 3
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True, kw_only=True)
class ProcessIdentity:
    """What tells one process from any other, now and after a restart: a pid is reused, a
    host reboots, containers have pid namespaces of their own."""

    host: str
    pid: int
    boot_id: str | None = None
    """``/proc/sys/kernel/random/boot_id``: new at every boot of the host."""
    pid_ns: str | None = None
    """The pid namespace (``/proc/self/ns/pid``): a pid means something only inside it."""
    start: int | None = None
    """The process's start time (:func:`process_start`)."""

    @staticmethod
    def this_process() -> ProcessIdentity:
        pid = os.getpid()
        ns = None
        with contextlib.suppress(OSError):
            ns = os.readlink("/proc/self/ns/pid")
        return ProcessIdentity(host=socket.gethostname(), pid=pid,
                               boot_id=_read_text("/proc/sys/kernel/random/boot_id"),
                               pid_ns=ns, start=process_start(pid))

    def same_machine(self, other: ProcessIdentity) -> bool:
        """``other``'s pid can be checked here: same host, boot and pid namespace (a field
        unknown on either side does not count against it)."""
        def agree(a: str | None, b: str | None) -> bool:
            return a is None or b is None or a == b

        return (self.host == other.host and agree(self.boot_id, other.boot_id)
                and agree(self.pid_ns, other.pid_ns))


@dataclass(frozen=True, kw_only=True)
class LeaseState:
    holder: str
    host: str
    pid: int
    epoch: int
    expires_t: float
    lineage: tuple[str | None, ...]
    boot_id: str | None = None
    pid_ns: str | None = None
    start: int | None = None
    ttl_s: float | None = None

    @property
    def process(self) -> ProcessIdentity:
        return ProcessIdentity(host=self.host, pid=self.pid, boot_id=self.boot_id,
                               pid_ns=self.pid_ns, start=self.start)

    def to_json(self) -> bytes:
        return json.dumps({"holder": self.holder, "host": self.host, "pid": self.pid,
                           "boot_id": self.boot_id, "pid_ns": self.pid_ns, "start": self.start,
                           "epoch": self.epoch, "expires_t": self.expires_t,
                           "ttl_s": self.ttl_s, "lineage": list(self.lineage)}).encode()

    @staticmethod
    def parse(data: bytes) -> LeaseState | None:
        try:
            doc = json.loads(data)

            def opt(key: str, kind: Any) -> Any:
                value = doc.get(key)
                return None if value is None else kind(value)

            return LeaseState(holder=str(doc["holder"]), host=str(doc["host"]),
                              pid=int(doc["pid"]), epoch=int(doc["epoch"]),
                              expires_t=float(doc["expires_t"]),
                              lineage=tuple(doc["lineage"]), boot_id=opt("boot_id", str),
                              pid_ns=opt("pid_ns", str), start=opt("start", int),
                              ttl_s=opt("ttl_s", float))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # unreadable: treated as no lease (the epoch restarts)

    def status(self, now: float, me: ProcessIdentity) -> str:
        """``"free"`` (expired or released), ``"gone"`` (its holder is known not to run),
        ``"alive"`` (it runs, here) or ``"unknown"`` (it ran where ``me`` cannot look)."""
        if self.expires_t <= now:
            return "free"
        holder = self.process
        if not me.same_machine(holder):
            return "unknown"
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            pass  # it exists, as another user's
        if self.start is not None:
            start = process_start(self.pid)
            if start is not None and start != self.start:
                return "gone"  # the pid was reused (a controller restarted with the same pid)
        return "alive"


class RootLease:
    """The lease of run ``run_id`` on ``storage``'s root, valid ``ttl_s`` past each renewal
    (renewed every ``ttl_s / 3`` once :meth:`start_heartbeat` is called)."""

    def __init__(self, storage: Storage, run_id: str, ttl_s: float, *,
                 identity: ProcessIdentity | None = None) -> None:
        self.storage = storage
        self.run_id = run_id
        self.ttl_s = ttl_s
        self.identity = identity or ProcessIdentity.this_process()
        self.path = storage.path(LEASE)
        self.epoch = 0
        self.lineage: tuple[str | None, ...] = (run_id,)
        self.renewed_t = 0.0
        self.lost: LeaseHeld | None = None
        """Set by the heartbeat when another controller took the lease."""
        self._lock = threading.RLock()  # the heartbeat's renewals against commits' checks
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def read(self) -> LeaseState | None:
        try:
            return LeaseState.parse(self.storage.read_bytes(self.path))
        except FileNotFoundError:
            return None

    def _write(self, expires_t: float) -> None:
        me = self.identity
        state = LeaseState(holder=self.run_id, host=me.host, pid=me.pid, boot_id=me.boot_id,
                           pid_ns=me.pid_ns, start=me.start, epoch=self.epoch,
                           expires_t=expires_t, ttl_s=self.ttl_s, lineage=self.lineage)
        st = self.storage
        st.makedirs(st.root)
        # A reader (a commit's check, a controller starting) never sees a half-written lease,
        # and a write that fails part-way (a full disk, a file system whose writes are not
        # atomic) leaves the lease as it was: a torn record would read as no lease at all.
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        data = state.to_json()
        try:
            st.write_bytes(tmp, data)
            try:
                st.replace_file(tmp, self.path)
            except NotImplementedError:  # a file system that cannot copy: a plain write
                st.remove(tmp)
                st.write_bytes(self.path, data)
        except BaseException:
            with contextlib.suppress(Exception):
                st.remove(tmp)
            raise

    def acquire(self) -> LeaseState | None:
        """Takes the lease; returns the previous holder's state (None: never held).
        :class:`LeaseHeld` if a live controller holds it. A holder this process cannot
        check (another host) is watched for at most its remaining time (at most its ttl):
        renewed meanwhile, it is live."""
        with self._lock:
            now = time.time()
            prev = self.read()
            if prev is not None and prev.holder != self.run_id:
                status = prev.status(now, self.identity)
                if status == "alive":
                    raise LeaseHeld(self._held_message(prev, now, "it runs on this host"))
                if status == "unknown":
                    prev = self._watch(prev)
                elif status == "gone":
                    _log.info("lease on %s: its holder (run %s, pid %d on %s) no longer runs: "
                              "taken over", self.storage.url(self.storage.root), prev.holder,
                              prev.pid, prev.host)
            now = time.time()
            self.epoch = (prev.epoch if prev is not None else 0) + 1
            self._write(now + self.ttl_s)
            self.check()
            self.renewed_t = now
            self.lost = None
            return prev

    def _watch(self, prev: LeaseState) -> LeaseState:
        """Waits until the lease ``prev`` is renewed (:class:`LeaseHeld`), released or
        expired, for at most the time it has left, capped at its ttl; returns what to take
        over (the newest record read)."""
        now = time.time()
        ttl = prev.ttl_s if prev.ttl_s and prev.ttl_s > 0 else self.ttl_s
        wait_s = min(max(0.0, prev.expires_t - now), ttl)  # a skewed clock cannot stretch it
        _log.warning(
            "checkpoint root %s: the lease is held by run %s (pid %d on %s), which this "
            "process cannot check; waiting up to %.0f s to see whether it is renewed",
            self.storage.url(self.storage.root), prev.holder, prev.pid, prev.host, wait_s)
        end = time.monotonic() + wait_s
        poll = min(WATCH_POLL_S, max(0.05, ttl / 30))
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return prev
            time.sleep(min(poll, left))  # the holder's renewal is what this waits for
            cur = self.read()
            if cur is None:
                return prev  # deleted: free (the last record read keeps its lineage)
            if cur == prev:
                continue
            if cur.expires_t <= time.time():
                return cur  # released meanwhile
            raise LeaseHeld(self._held_message(cur, time.time(), "it was renewed while this "
                                               "controller waited"))

    def _held_message(self, held: LeaseState, now: float, why: str) -> str:
        return (
            f"checkpoint root {self.storage.url(self.storage.root)} is in use by run "
            f"{held.holder} (pid {held.pid} on {held.host}, lease valid for "
            f"{held.expires_t - now:.0f} s more; {why}): two jobs must not write one root; "
            "give this one another root, or stop the other"
        )

    def check(self) -> None:
        """:class:`LeaseHeld` unless this run still holds the lease at its epoch."""
        with self._lock:
            cur = self.read()
            if cur is None or cur.holder != self.run_id or cur.epoch != self.epoch:
                who = "nobody" if cur is None else f"run {cur.holder} (epoch {cur.epoch})"
                raise LeaseHeld(f"lost the lease on {self.storage.url(self.storage.root)} "
                                f"(epoch {self.epoch}): it is now held by {who}")

    def set_lineage(self, lineage: tuple[str | None, ...]) -> None:
        with self._lock:
            self.lineage = lineage
            self.renew()

    def renew(self) -> None:
        """Checks the lease is still ours and extends it by ``ttl_s``."""
        with self._lock:
            self.check()
            now = time.time()
            self._write(now + self.ttl_s)
            self.renewed_t = now

    def start_heartbeat(self) -> None:
        """Renews the lease every ``ttl_s / 3`` from a daemon thread until :meth:`release`
        (or :meth:`stop_heartbeat`): a controller busy for long (a restore, a wait for
        replacements) keeps its lease, and one that dies loses it within ``ttl_s``."""
        if self._heartbeat is not None and self._heartbeat.is_alive():
            return
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._beat, name="planaria-lease",
                                           daemon=True)
        self._heartbeat.start()

    def stop_heartbeat(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        thread = self._heartbeat
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout_s)
        self._heartbeat = None

    def _beat(self) -> None:
        period = self.ttl_s / 3
        failing = False
        while not self._stop.wait(period):
            try:
                self.renew()
            except LeaseHeld as err:
                self.lost = err  # the next commit's check fails too (fencing)
                _log.error("%s; this job's saves will not commit", err)
                return
            except Exception as err:  # storage: tried again at the next beat
                if not failing:
                    _log.warning("could not renew the lease on %s (%s: %s); trying again "
                                 "every %.0f s", self.storage.url(self.storage.root),
                                 type(err).__name__, err, period)
                failing = True
                continue
            if failing:
                _log.info("the lease on %s is renewed again", self.storage.url(self.storage.root))
            failing = False

    def release(self) -> None:
        """Lets the lease go at once (the lineage stays, for a run that resumes)."""
        self.stop_heartbeat()
        with self._lock:
            self.check()
            self._write(0.0)
