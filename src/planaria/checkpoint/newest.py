"""Which checkpoint a restore takes: the newest committed checkpoint of a lineage that is
viable, falling back to older ones with a warning for each one skipped.

One rule for every restore (:meth:`LineageCheckpoints.first_viable`): a job's
(:mod:`planaria.checkpoint.restoring`: viable means every replica loaded it) and a
program's own (:func:`latest_viable`: it verifies; :func:`load_latest`: it loads and
verifies). A root can hold several runs' checkpoints; only the lineage's count (the runs
a run continues, named in each commit marker; None stands for markers that name no run:
checkpoints committed without a run id).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from planaria.checkpoint.backoff import with_retries
from planaria.checkpoint.errors import CheckpointError, NoViableCheckpoint
from planaria.checkpoint.restore import (
    CheckpointInfo,
    Restored,
    list_checkpoints,
    load_checkpoint,
    read_run_id,
    verify_checkpoint,
)
from planaria.faults.errors import StorageError

__all__ = [
    "UNREADABLE",
    "LineageCheckpoints",
    "NotViable",
    "latest_viable",
    "lineage_checkpoints",
    "load_latest",
    "run_of",
]

T = TypeVar("T")
UNREADABLE = "unreadable"
""":func:`run_of` for a checkpoint whose marker cannot be read: whose it is is unknown."""


class NotViable(Exception):
    """Raised by a :func:`first_viable` attempt: this checkpoint is skipped (the message
    says why) and the next older one is tried."""


def run_of(c: CheckpointInfo, *, storage_options: Mapping[str, Any] | None = None,
           attempts: int = 3, backoff_s: float = 0.5) -> str | None:
    """The run that committed ``c``; :data:`UNREADABLE` when its marker cannot be read,
    after the storage's retries (a transient error must not hide a checkpoint)."""
    return _read_run(c, storage_options, attempts, backoff_s)[0]


def _read_run(c: CheckpointInfo, storage_options: Mapping[str, Any] | None, attempts: int,
              backoff_s: float) -> tuple[str | None, str]:
    try:
        return with_retries(
            functools.partial(read_run_id, c.path, storage_options=storage_options),
            what=f"reading the marker of {c.path}", attempts=attempts,
            backoff_s=backoff_s), ""
    except (CheckpointError, StorageError, OSError) as err:
        return UNREADABLE, f"{type(err).__name__}: {err}"


@dataclass(frozen=True, kw_only=True)
class LineageCheckpoints:
    """A lineage's committed checkpoints under a root, as :func:`lineage_checkpoints` found
    them."""

    candidates: list[CheckpointInfo]
    """The lineage's, newest first."""
    unreadable: list[tuple[CheckpointInfo, str]]
    """Committed checkpoints whose marker could not be read (whose they are is unknown),
    with the error."""

    def first_viable(
        self, attempt: Callable[[CheckpointInfo], T],
    ) -> tuple[tuple[CheckpointInfo, T] | None, list[str]]:
        """Tries the candidates newest first with ``attempt``, which raises
        :class:`NotViable` for one to skip (any other error ends the search); returns the
        first that passed with what ``attempt`` returned (None if none did), and a warning
        per checkpoint skipped, those whose marker could not be read included."""
        warnings: list[str] = []
        found: tuple[CheckpointInfo, T] | None = None
        for c in self.candidates:
            try:
                found = (c, attempt(c))
                break
            except NotViable as err:
                warnings.append(f"step {c.step} ({c.path}) skipped: {err}")
        above = found[0].step if found is not None else -1
        unknown = [f"step {c.step} ({c.path}) skipped: its commit marker could not be read "
                   f"({why}), so whose it is is unknown" for c, why in self.unreadable
                   if c.step > above]
        return found, unknown + warnings


def lineage_checkpoints(
    root: str, lineage: Collection[str | None], *,
    storage_options: Mapping[str, Any] | None = None, attempts: int = 3,
    backoff_s: float = 0.5, infos: Sequence[CheckpointInfo] | None = None,
) -> LineageCheckpoints:
    """The committed checkpoints of ``lineage`` under ``root``, newest first (``infos``:
    the root's listing, when the caller has it). :class:`NoViableCheckpoint` when there
    are none but some committed checkpoint's marker could not be read: it may be the
    lineage's, so this is not "none saved yet" (which would start over)."""
    if infos is None:
        infos = with_retries(
            functools.partial(list_checkpoints, root, storage_options=storage_options),
            what=f"listing {root}", attempts=attempts, backoff_s=backoff_s)
    committed = [c for c in infos if c.committed]
    runs = {c.path: _read_run(c, storage_options, attempts, backoff_s) for c in committed}
    own = [c for c in reversed(committed) if runs[c.path][0] in lineage]
    unreadable = [(c, runs[c.path][1]) for c in reversed(committed)
                  if runs[c.path][0] == UNREADABLE]
    if not own and unreadable:
        raise NoViableCheckpoint(
            f"the markers of {len(unreadable)} committed checkpoints under {root} "
            f"could not be read ({', '.join(c.path for c, _ in reversed(unreadable))}): "
            "whether they are this run's is unknown; fix the storage's access and resume"
        )
    return LineageCheckpoints(candidates=own, unreadable=unreadable)


def _torn(infos: Sequence[CheckpointInfo], above: int) -> list[str]:
    return [f"step {c.step} ({c.path}) is not committed (an unfinished save)"
            for c in infos if not c.committed and c.step > above]


def latest_viable(
    root: str, *, lineage: Collection[str | None],
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[str | None, list[str]]:
    """The newest committed checkpoint of ``lineage`` under ``root`` that verifies, and
    warnings naming what was wrong with every newer one (file and tensor).
    ``(None, warnings)`` if none."""
    infos = list_checkpoints(root, storage_options=storage_options)

    def verified(c: CheckpointInfo) -> None:
        report = verify_checkpoint(c.path, storage_options=storage_options)
        if not report.ok:
            raise NotViable("; ".join(report.problems))

    found, warnings = lineage_checkpoints(
        root, lineage, storage_options=storage_options, infos=infos).first_viable(verified)
    return (found[0].path if found else None,
            _torn(infos, found[0].step if found else -1) + warnings)


def load_latest(
    root: str,
    *,
    lineage: Collection[str | None],
    names: Collection[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    attempts: int = 3,
    backoff_s: float = 0.5,
) -> tuple[Restored | None, list[str]]:
    """Loads the newest committed checkpoint of ``lineage`` under ``root`` that verifies,
    reading each byte once (verification overlaps the load); falls back to older ones,
    with a warning for each one skipped. A storage error is retried (``attempts`` in all,
    with backoff from ``backoff_s``) before the checkpoint is skipped.
    ``(None, warnings)`` if none is viable."""
    infos = list_checkpoints(root, storage_options=storage_options)

    def loaded(c: CheckpointInfo) -> Restored:
        try:
            tensors, meta = with_retries(
                functools.partial(load_checkpoint, c.path, names=names,
                                  storage_options=storage_options),
                what=f"loading {c.path}", attempts=attempts, backoff_s=backoff_s,
            )
        except (CheckpointError, StorageError) as err:
            raise NotViable(str(err)) from err
        return Restored(c.path, c.step, tensors, meta)

    found, warnings = lineage_checkpoints(
        root, lineage, storage_options=storage_options, attempts=attempts, backoff_s=backoff_s,
        infos=infos).first_viable(loaded)
    return (found[1] if found else None,
            _torn(infos, found[0].step if found else -1) + warnings)
