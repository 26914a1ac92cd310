"""The root a job's checkpoints go under, and this run's identity there: its run id, the
lineage it continues and its lease on the root. Shared by the coordinator's parts."""

from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from planaria.checkpoint.backoff import with_retries
from planaria.checkpoint.config import CheckpointConfig
from planaria.checkpoint.lease import RootLease
from planaria.checkpoint.newest import LineageCheckpoints, lineage_checkpoints, run_of
from planaria.checkpoint.restore import CheckpointInfo, list_checkpoints
from planaria.checkpoint.storage import Storage

__all__ = ["CheckpointRoot"]

T = TypeVar("T")


class CheckpointRoot:
    """Where checkpoints go (``root``: absolute unless a URL; ``options``: its storage's),
    as run ``run_id`` (a fresh one unless given) continuing ``lineage`` (oldest first,
    this run last), under ``lease``."""

    def __init__(self, config: CheckpointConfig, run_dir: Path | str, *,
                 run_id: str | None = None) -> None:
        self.config = config
        root = config.root or str(Path(run_dir) / "checkpoints")
        self.root = os.path.abspath(root) if "://" not in root else root
        self.options = dict(config.storage_options)
        self.run_id = run_id or secrets.token_hex(8)
        self.lineage: tuple[str | None, ...] = (self.run_id,)
        """Runs whose checkpoints this one continues (oldest first, this run last)."""
        self.lease = RootLease(self.storage(), self.run_id, config.lease_ttl_s)
        self.local = self.storage().local

    def storage(self) -> Storage:
        return Storage(self.root, self.options)

    def call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()``, a storage operation, retried on storage errors (``storage_attempts``)."""
        return with_retries(fn, what=what, attempts=self.config.storage_attempts)

    def deadline(self, nbytes: int) -> float:
        """A save's or a restore's deadline: the base, plus time for its bytes."""
        return self.config.timeout_s + nbytes / self.config.min_bytes_per_s

    def committed(self) -> list[CheckpointInfo]:
        """Every committed checkpoint under the root, whoever's, oldest first."""
        infos = self.call(functools.partial(list_checkpoints, self.root,
                                            storage_options=self.options),
                          f"listing {self.root}")
        return [c for c in infos if c.committed]

    def run_of(self, c: CheckpointInfo) -> str | None:
        """The run that committed ``c`` (``"unreadable"``: its marker cannot be read)."""
        return run_of(c, storage_options=self.options, attempts=self.config.storage_attempts)

    def candidates(self) -> LineageCheckpoints:
        """This lineage's committed checkpoints, newest first (see
        :func:`~planaria.checkpoint.newest.lineage_checkpoints`)."""
        return lineage_checkpoints(self.root, self.lineage, storage_options=self.options,
                                   attempts=self.config.storage_attempts)
