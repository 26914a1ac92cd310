"""Logging while the progress display runs: records go through the live console (above the
bar) and come back to their streams after; a record restating an event the display prints
is left out; the closing status line is not printed twice."""

from __future__ import annotations

import io
import logging
import sys
from typing import Any

from rich.console import Console

from planaria.observe.logs import RESTATES, logs_beside_display, terminal_handlers
from planaria.observe.progress import ProgressDisplay


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def _commit(t: float, step: int) -> dict[str, Any]:
    return {"t": t, "event": "step_committed", "step": step, "width": 2, "loss": 0.5,
            "samples": 8}


def _handler_on(stream: Any, monkeypatch: Any) -> logging.StreamHandler[Any]:
    monkeypatch.setattr(sys, "stderr", stream)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("planaria.test_display")
    logger.addHandler(handler)
    logger.propagate = False
    return handler


def test_terminal_handlers_write_through_the_display_and_are_put_back(monkeypatch):
    tty = _FakeTTY()
    handler = _handler_on(tty, monkeypatch)
    logger = logging.getLogger("planaria.test_display")
    through = io.StringIO()
    try:
        assert handler in terminal_handlers() and logging.lastResort in terminal_handlers()
        with logs_beside_display({"fault"}, through=lambda stream: through):  # type: ignore[arg-type,return-value]
            logger.warning("seen above the bar")
            logger.warning("a fault restated", extra={RESTATES: "fault"})
            logger.warning("a save restated", extra={RESTATES: "checkpoint_failed"})
        assert through.getvalue() == "WARNING seen above the bar\nWARNING a save restated\n"
        assert handler.stream is tty and not handler.filters
        logger.warning("a fault restated", extra={RESTATES: "fault"})
        assert tty.getvalue() == "WARNING a fault restated\n"  # no display: told by the log
    finally:
        logger.removeHandler(handler)


def test_a_warning_on_a_terminal_prints_on_its_own_line_above_the_bar(monkeypatch):
    tty = _FakeTTY()
    handler = _handler_on(tty, monkeypatch)
    logger = logging.getLogger("planaria.test_display")
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    try:
        with ProgressDisplay(10, 2, console=console, summary=False) as display:
            display(_commit(1.0, 0))
            logger.warning("disk almost full")
            logger.warning("w1 lost", extra={RESTATES: "fault"})
            display(_commit(2.0, 1))
        assert tty.getvalue() == "" and handler.stream is tty
        text = out.getvalue()
        assert "\x1b[2KWARNING disk almost full\n" in text.replace("\r", "")
        assert "w1 lost" not in text
    finally:
        logger.removeHandler(handler)


def test_plain_the_last_status_line_prints_once_and_a_summary_line():
    out = io.StringIO()
    display = ProgressDisplay(3, 2, console=Console(file=out, width=200), every_s=1e9,
                              summary="line")
    display.start()
    for step in range(3):
        display(_commit(float(step), step))
    display({"t": 3.5, "event": "run_end", "status": "ok", "step": 3, "wall_s": 3.5})
    display.stop()
    lines = out.getvalue().splitlines()
    assert sum(line.startswith("step 3/3 ") for line in lines) == 1, lines
    assert lines[-1].startswith("run ok: 3 steps in "), lines


def test_planaria_leaves_a_record_to_the_users_root_handler_on_the_same_stream(monkeypatch):
    from planaria.observe.logs import setup_logging

    stream = io.StringIO()
    root = logging.getLogger()
    users = logging.StreamHandler(stream)  # as logging.basicConfig() installs
    users.setFormatter(logging.Formatter("user-format %(message)s"))
    root.addHandler(users)
    planaria = logging.getLogger("planaria")
    before = (planaria.level, list(planaria.handlers))
    try:
        mine = setup_logging(0, stream=stream)
        logging.getLogger("planaria.faults").warning("told once")
        assert stream.getvalue() == "user-format told once\n"
        root.removeHandler(users)
        logging.getLogger("planaria.faults").warning("told by planaria")
        assert stream.getvalue().count("told by planaria") == 1
        assert "WARNING faults" in stream.getvalue()
    finally:
        root.removeHandler(users)
        planaria.removeHandler(mine)
        planaria.setLevel(before[0])
        for h in before[1]:
            if h not in planaria.handlers:
                planaria.addHandler(h)


def test_a_resumed_step_is_told_under_faults():
    """step_resumed (the survivors kept micro-batches of the failed step) is an INFO line of
    planaria.faults, saying how many were kept and redone."""
    from planaria.observe.logs import log_event

    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    logger = logging.getLogger("planaria.faults")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        log_event({"t": 1.0, "event": "step_resumed", "step": 31, "gen": 1, "kept": 4,
                   "redone": 2, "total": 6})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    [rec] = seen
    assert rec.levelno == logging.INFO
    assert "step_resumed" in rec.getMessage() and "kept=4 redone=2" in rec.getMessage()
