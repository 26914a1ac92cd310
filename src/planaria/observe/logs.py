"""Structured logging per concern: membership, commits, checkpoints, faults, data.

Each concern has its own logger under ``planaria.`` so it can be tuned alone
(``logging.getLogger("planaria.commits").setLevel(logging.DEBUG)``).
:func:`setup_logging` installs one concise handler; :func:`log_event` is an
optional event listener that logs each event record under its concern.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Collection, Iterator
from typing import Any, TextIO, TypeGuard

__all__ = [
    "CONCERNS",
    "RESTATES",
    "checkpoints",
    "commits",
    "data",
    "faults",
    "log_event",
    "logs_beside_display",
    "membership",
    "setup_logging",
    "terminal_handlers",
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

    Calling it again replaces the handler it installed before (no duplicates); a record that
    a handler of the root logger prints to the same stream (the user's code called
    ``logging.basicConfig``) is left to it, not printed twice.
    """
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    root = logging.getLogger("planaria")
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(_ConcernFormatter(FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_LeftToTheRoot(handler))
    root.addHandler(handler)
    root.setLevel(level)
    return handler


class _LeftToTheRoot(logging.Filter):
    """Drops a record that also reaches a handler of the root logger printing to the same
    stream: without it, a script that calls ``logging.basicConfig`` sees each line twice."""

    def __init__(self, handler: logging.StreamHandler[TextIO]) -> None:
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None and logger.propagate and logger.parent is not None:
            logger = logger.parent
        if logger is not logging.getLogger():
            return True  # the record stops before the root
        mine = _underlying(self.handler.stream)
        return not any(_prints(h) and _underlying(h.stream) is mine and record.levelno >= h.level
                       for h in logger.handlers)


def _prints(handler: logging.Handler) -> TypeGuard[logging.StreamHandler[Any]]:
    """Whether ``handler`` writes to a stream rather than a file."""
    return (isinstance(handler, logging.StreamHandler)
            and not isinstance(handler, logging.FileHandler))


def _underlying(stream: Any) -> Any:
    """The stream itself, or the one a live display's stand-in (rich's FileProxy) wraps."""
    return getattr(stream, "rich_proxied_file", stream)


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
    "state_received": (membership, logging.INFO),
    "joined": (membership, logging.INFO),
    "preempt_notice": (membership, logging.WARNING),
    "drained": (membership, logging.INFO),
    "chaos": (faults, logging.INFO),
    "fault": (faults, logging.WARNING),
    "detected": (faults, logging.DEBUG),
    "hang_stack": (faults, logging.WARNING),
    "action": (faults, logging.INFO),
    "recovered": (faults, logging.INFO),
    "step_resumed": (faults, logging.INFO),
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


RESTATES = "restates"
"""The attribute of a log record that restates an event for a reader without a display
(``_log.warning(..., extra={RESTATES: "fault"})``): while a display that prints that event's
own line is running, the terminal leaves the record out, so the fault is told once."""


def terminal_handlers() -> list[logging.Handler]:
    """The handlers that write to this process's stdout or stderr: planaria's own
    (:func:`setup_logging`), the user's (``logging.basicConfig``), a library's, and logging's
    last resort (which prints a WARNING nobody handles to ``sys.stderr``)."""
    streams = [sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__]
    # a live display's stand-in for a stream (rich's FileProxy) names the stream it wraps
    standard = {id(s) for s in (*streams, *map(_underlying, streams)) if s is not None}
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    found: list[logging.Handler] = []
    for logger in loggers:
        for handler in logger.handlers:
            if (_prints(handler) and id(handler.stream) in standard
                    and handler not in found):
                found.append(handler)
    if logging.lastResort is not None and logging.lastResort not in found:
        found.append(logging.lastResort)
    return found


class _LeaveOutShown(logging.Filter):
    """Drops a record that restates an event the display prints."""

    def __init__(self, shown: Collection[str]) -> None:
        super().__init__()
        self.shown = frozenset(shown)

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, RESTATES, None) not in self.shown


@contextlib.contextmanager
def logs_beside_display(
    shown: Collection[str], *, through: Callable[[TextIO], TextIO] | None = None
) -> Iterator[None]:
    """For the block, the :func:`terminal_handlers` leave out the records that restate an
    event in ``shown`` (the display prints its own line for it), and, with ``through``,
    those writing to a terminal write to ``through(their stream)`` instead: a live display's
    console, which prints each line above its bar. Each handler keeps its format, level and
    filters; all is put back after the block."""
    handlers = terminal_handlers()
    leave_out = _LeaveOutShown(shown)
    swapped: list[tuple[logging.StreamHandler[TextIO], TextIO]] = []
    try:
        for handler in handlers:
            handler.addFilter(leave_out)
            if (through is not None and isinstance(handler, logging.StreamHandler)
                    and not isinstance(getattr(type(handler), "stream", None), property)
                    and _is_tty(handler.stream)):
                # (logging's last resort has a property: sys.stderr as it is at each record,
                # which a live display already sends through its console.)
                old = handler.stream
                handler.setStream(through(old))
                swapped.append((handler, old))
        yield
    finally:
        for handler, old in swapped:
            handler.setStream(old)
        for handler in handlers:
            handler.removeFilter(leave_out)


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
