"""Structured logging per concern: membership, commits, checkpoints, faults, data.

Each concern has its own logger under ``planaria.`` so it can be tuned alone
(``logging.getLogger("planaria.commits").setLevel(logging.DEBUG)``).
:func:`setup_logging` installs one concise handler; :func:`log_event` is an
optional event listener that logs each event record under its concern.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

__all__ = [
    "CONCERNS",
    "checkpoints",
    "commits",
    "data",
    "faults",
    "log_event",
    "membership",
    "setup_logging",
]

CONCERNS = ("membership", "commits", "checkpoints", "faults", "data")

membership = logging.getLogger("planaria.membership")
commits = logging.getLogger("planaria.commits")
checkpoints = logging.getLogger("planaria.checkpoints")
faults = logging.getLogger("planaria.faults.user_code")
data = logging.getLogger("planaria.data")

FORMAT = "%(asctime)s %(levelname)-7s %(concern)-11s %(message)s"
_HANDLER_NAME = "planaria"


class _ConcernFormatter(logging.Formatter):
    """Adds ``concern``: the logger name without its ``planaria.`` prefix."""

    def format(self, record: logging.LogRecord) -> str:
        name = record.name
        record.concern = name.removeprefix("planaria.") if name != "planaria" else "planaria"
        return super().format(record)


def setup_logging(verbosity: int = 0, *, stream: TextIO | None = None) -> logging.Handler:
    """Sends ``planaria.*`` logs to ``stream`` (stderr): 0 WARNING, 1 INFO, 2+ DEBUG.

    Calling it again replaces the handler it installed before (no duplicates).
    """
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    root = logging.getLogger("planaria")
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(_ConcernFormatter(FORMAT, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
    return handler


# event -> (concern logger, level)
_ROUTES: dict[str, tuple[logging.Logger, int]] = {
    "run_start": (commits, logging.INFO),
    "run_end": (commits, logging.INFO),
    "step_committed": (commits, logging.DEBUG),
    "step_failed": (commits, logging.WARNING),
    "step_skipped": (commits, logging.WARNING),
    "worker_started": (membership, logging.INFO),
    "generation": (membership, logging.INFO),
    "replacement_requested": (membership, logging.INFO),
    "replacement_ready": (membership, logging.INFO),
    "replacement_failed": (membership, logging.WARNING),
    "state_transfer": (membership, logging.INFO),
    "joined": (membership, logging.INFO),
    "preempt_notice": (membership, logging.WARNING),
    "drained": (membership, logging.INFO),
    "chaos": (faults, logging.INFO),
    "fault": (faults, logging.WARNING),
    "detected": (faults, logging.DEBUG),
    "hang_stack": (faults, logging.WARNING),
    "action": (faults, logging.INFO),
    "recovered": (faults, logging.INFO),
    "checkpoint_saved": (checkpoints, logging.INFO),
    "checkpoint_failed": (checkpoints, logging.WARNING),
    "checkpoint_interval": (checkpoints, logging.INFO),
    "restore": (checkpoints, logging.WARNING),
}
_SKIP = {"t", "event", "config", "metrics", "stack"}


def log_event(record: dict[str, Any]) -> None:
    """Logs an event record under its concern as ``event key=value ...``.

    ``step_committed`` also logs its data wait under ``planaria.data`` (DEBUG).
    The record itself travels in ``extra={"event_record": record}``.
    """
    ev = record.get("event", "?")
    logger, level = _ROUTES.get(ev, (logging.getLogger("planaria"), logging.DEBUG))
    if logger.isEnabledFor(level):
        fields = " ".join(f"{k}={v}" for k, v in record.items() if k not in _SKIP)
        logger.log(level, "%s %s", ev, fields, extra={"event_record": record})
    if ev == "step_committed" and record.get("data_wait_s") and data.isEnabledFor(logging.DEBUG):
        data.debug("step %s waited %.3f s for data", record.get("step"), record["data_wait_s"],
                   extra={"event_record": record})
