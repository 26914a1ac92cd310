"""The lease on a checkpoint root: one controller writes a root at a time, and the root
remembers the lineage of runs that wrote it.

``LEASE.json`` at the root names the holder (a run id, its host and pid), an
``epoch`` that grows by one at each acquisition (the fencing token: a commit
checks it is still the holder's before it writes the marker), when the lease
expires unless renewed, and the holder's lineage (the run ids whose checkpoints
it continues, oldest first). A lease is free once expired, released, or held by
a process of this host that no longer runs (a controller killed and restarted).

Acquisition is read, write, read back: on storage without conditional writes two
controllers starting within the same instant may both pass it; the epoch check
at every commit then stops the one that lost.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass

from planaria.checkpoint.errors import LeaseHeld
from planaria.checkpoint.storage import Storage

__all__ = ["LEASE", "LeaseState", "RootLease"]

LEASE = "LEASE.json"


@dataclass(frozen=True, kw_only=True)
class LeaseState:
    holder: str
    host: str
    pid: int
    epoch: int
    expires_t: float
    lineage: tuple[str | None, ...]

    def to_json(self) -> bytes:
        return json.dumps({"holder": self.holder, "host": self.host, "pid": self.pid,
                           "epoch": self.epoch, "expires_t": self.expires_t,
                           "lineage": list(self.lineage)}).encode()

    @staticmethod
    def parse(data: bytes) -> LeaseState | None:
        try:
            doc = json.loads(data)
            return LeaseState(holder=str(doc["holder"]), host=str(doc["host"]),
                              pid=int(doc["pid"]), epoch=int(doc["epoch"]),
                              expires_t=float(doc["expires_t"]),
                              lineage=tuple(doc["lineage"]))
        except (ValueError, KeyError, TypeError):
            return None  # unreadable: treated as no lease (the epoch restarts)

    def live(self, now: float) -> bool:
        """Held by a running controller (as far as this process can tell)."""
        if self.expires_t <= now:
            return False
        if self.host == socket.gethostname():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
        return True


class RootLease:
    """The lease of run ``run_id`` on ``storage``'s root, valid ``ttl_s`` past each renewal."""

    def __init__(self, storage: Storage, run_id: str, ttl_s: float) -> None:
        self.storage = storage
        self.run_id = run_id
        self.ttl_s = ttl_s
        self.path = storage.path(LEASE)
        self.epoch = 0
        self.lineage: tuple[str | None, ...] = (run_id,)
        self.renewed_t = 0.0

    def read(self) -> LeaseState | None:
        try:
            return LeaseState.parse(self.storage.read_bytes(self.path))
        except FileNotFoundError:
            return None

    def _write(self, expires_t: float) -> None:
        state = LeaseState(holder=self.run_id, host=socket.gethostname(), pid=os.getpid(),
                           epoch=self.epoch, expires_t=expires_t, lineage=self.lineage)
        self.storage.makedirs(self.storage.root)
        self.storage.write_bytes(self.path, state.to_json())

    def acquire(self) -> LeaseState | None:
        """Takes the lease; returns the previous holder's state (None: never held).
        :class:`LeaseHeld` if a live controller holds it."""
        now = time.time()
        prev = self.read()
        if prev is not None and prev.holder != self.run_id and prev.live(now):
            raise LeaseHeld(
                f"checkpoint root {self.storage.url(self.storage.root)} is in use by run "
                f"{prev.holder} (pid {prev.pid} on {prev.host}, lease valid for "
                f"{prev.expires_t - now:.0f} s more): two jobs must not write one root; give "
                "this one another root, or stop the other"
            )
        self.epoch = (prev.epoch if prev is not None else 0) + 1
        self._write(now + self.ttl_s)
        self.check()
        self.renewed_t = now
        return prev

    def check(self) -> None:
        """:class:`LeaseHeld` unless this run still holds the lease at its epoch."""
        cur = self.read()
        if cur is None or cur.holder != self.run_id or cur.epoch != self.epoch:
            who = "nobody" if cur is None else f"run {cur.holder} (epoch {cur.epoch})"
            raise LeaseHeld(f"lost the lease on {self.storage.url(self.storage.root)} (epoch "
                            f"{self.epoch}): it is now held by {who}")

    def set_lineage(self, lineage: tuple[str | None, ...]) -> None:
        self.lineage = lineage
        self.renew()

    def renew(self) -> None:
        """Checks the lease is still ours and extends it by ``ttl_s``."""
        self.check()
        now = time.time()
        self._write(now + self.ttl_s)
        self.renewed_t = now

    def release(self) -> None:
        """Lets the lease go at once (the lineage stays, for a run that resumes)."""
        self.check()
        self._write(0.0)
