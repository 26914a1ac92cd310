"""The live progress display in non-terminal mode: plain lines, no control codes."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from planaria.observe.progress import ProgressDisplay


def _ev(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "event": event, **fields}


def _commit(t: float, step: int, width: int) -> dict[str, Any]:
    return _ev(t, "step_committed", step=step, gen=0, width=width, duration_s=0.9, loss=0.5,
               samples=12, samples_per_s=13.3, data_wait_s=0.0)


def _feed() -> list[dict[str, Any]]:
    return [_ev(0.0, "run_start", run_id="p", replicas=3, steps=6, start_step=0),
            _ev(0.5, "generation", gen=0, world_size=3), _commit(1.0, 0, 3), _commit(2.0, 1, 3),
            _ev(2.5, "checkpoint_saved", step=1, stall_s=0.02, save_s=0.1),
            _ev(3.1, "fault", fault_id="f1", kind="worker_lost", worker="w2", step=2, fault_t=3.0),
            _ev(3.1, "replacement_requested", worker="w3", replaces="w2"),
            _ev(3.2, "generation", gen=1, world_size=2), _commit(3.31, 2, 2),
            _ev(3.31, "recovered", fault_id="f1", step=2, recover_s=0.31, lost_steps=0),
            _ev(4.0, "replacement_ready", worker="w3", replacement_s=0.9),
            _ev(4.1, "generation", gen=2, world_size=3), _commit(5.3, 3, 3),
            _ev(5.3, "joined", worker="w3", gen=2, step=3, join_s=1.2),
            _commit(6.3, 4, 3), _commit(7.3, 5, 3),
            _ev(7.5, "run_end", status="ok", step=5, wall_s=7.5, error=None)]


def test_non_tty_prints_plain_recovery_lines() -> None:
    out = io.StringIO()
    display = ProgressDisplay(6, 3, console=Console(file=out, width=100), every_s=1e9)
    display.start()
    for rec in _feed():
        display(rec)
    display.stop()
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text
    assert "w2 lost → 2 replicas in 0.31 s, replacement joining" in text
    assert "w3 joined (hot-join 1.2 s)" in text
    assert "checkpoint step 1 saved (stall 0.02 s)" in text
    assert "step 6/6" in text and "replicas 3/3" in text
    assert "where the time went" in text  # the summary at stop


def test_status_line_rate_and_eta() -> None:
    display = ProgressDisplay(10, 2, console=Console(file=io.StringIO()), quiet=True)
    for i in range(3):
        display(_commit(float(i), i, 2))
    assert display.samples_per_s() == 12.0
    assert display.eta_s() == 7.0
    assert "step 3/10" in display.status_line() and "ETA 0:07" in display.status_line()


def test_quiet_prints_nothing() -> None:
    out = io.StringIO()
    display = ProgressDisplay(6, 3, console=Console(file=out), quiet=True)
    display.start()
    for rec in _feed():
        display(rec)
    display.stop()
    assert out.getvalue() == ""


def test_terminal_mode_runs() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with ProgressDisplay(6, 3, console=console, summary=False) as display:
        for rec in _feed():
            display(rec)
    assert "w3 joined (hot-join 1.2 s)" in out.getvalue()


def test_an_evaluation_prints_a_line() -> None:
    out = io.StringIO()
    display = ProgressDisplay(6, 3, console=Console(file=out, width=100), every_s=1e9,
                              summary=False)
    display.start()
    for rec in _feed()[:4]:
        display(rec)
    display(_ev(2.2, "eval", step=2, metrics={"loss": 0.123456, "acc": 0.75}, samples=100,
                seconds=0.31, width=3))
    display.stop()
    assert "eval at step 2: loss 0.1235, acc 0.75 (100 samples, 0.31 s)" in out.getvalue()
