"""Keeping the root in order beside the saves, on a background thread: retention (old
checkpoints of this lineage deleted) and the lease's renewal."""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from planaria.checkpoint.host import EventSink
from planaria.checkpoint.retention import apply_retention
from planaria.checkpoint.root import CheckpointRoot

__all__ = ["RootUpkeep"]

_log = logging.getLogger("planaria.checkpoint")


class RootUpkeep:
    """Retention and lease renewal for ``root``, one at a time on their own thread.
    ``paused``: retention deletes nothing (a restore is choosing a checkpoint)."""

    def __init__(self, root: CheckpointRoot, log: EventSink) -> None:
        self.root = root
        self.log = log
        self.paused = False
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planaria-retain")
        self._retention: Future[list[int]] | None = None
        self._renewal: Future[None] | None = None

    def retain(self) -> None:
        """Deletes old checkpoints of this lineage in the background. Every shard was checked
        by its writer as it was written, so nothing is read back; never while paused, and
        never fewer than two are kept."""
        config = self.root.config
        if config.keep_last is None or self.paused:
            return
        self.check_retention()
        if self._retention is not None:
            return  # the next save retains
        self._retention = self._thread.submit(
            apply_retention, self.root.root, keep_last=max(2, config.keep_last),
            keep_every=config.keep_every, storage_options=self.root.options,
            verify_newest=False, run_ids=self.root.lineage,
        )

    def check_retention(self) -> None:
        """Reports the outcome of a finished retention pass (``retention_failed`` if it failed)."""
        fut = self._retention
        if fut is None or not fut.done():
            return
        self._retention = None
        try:
            deleted = fut.result()
        except Exception as err:
            _log.warning("checkpoint retention failed: %s: %s", type(err).__name__, err)
            self.log.emit("retention_failed", error=f"{type(err).__name__}: {err}")
            return
        if deleted:
            _log.info("retention deleted the checkpoints of steps %s", deleted)

    def wait_retention(self, timeout_s: float | None = None) -> None:
        """Waits (bounded: ``timeout_s``, else the checkpoint timeout) for a retention pass
        in flight, and reports it."""
        fut = self._retention
        if fut is None:
            return
        with contextlib.suppress(Exception):  # reported by check_retention
            fut.exception(timeout=timeout_s or self.root.config.timeout_s)
        self.check_retention()

    def keep_lease(self) -> None:
        """Renews the root's lease in the background once a third of its time has passed."""
        lease = self.root.lease
        if time.time() - lease.renewed_t <= self.root.config.lease_ttl_s / 3:
            return
        if self._renewal is not None and not self._renewal.done():
            return
        if self._renewal is not None and self._renewal.exception() is not None:
            _log.warning("could not renew the lease on %s: %s", self.root.root,
                         self._renewal.exception())
        lease.renewed_t = time.time()  # one attempt per third of the lease
        self._renewal = self._thread.submit(lease.renew)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False)
