"""``planaria run`` on a real terminal and piped, with a kill and a warning mid-run: the
warning prints above the live bar (never glued to it), and each status and recovery line
prints once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cli.terminal import on_a_terminal, pieces, piped, python

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "planaria" / "examples"
# kill:w9 names no worker: the controller logs a planaria WARNING at step 6, mid-run.
CHAOS = "kill:w1@step3,kill:w9@step6"
WARNING = "chaos kill:w9 skipped: no such live worker"
BAR = "━"


def _run(run_dir: Path) -> list[str]:
    return python("-m", "planaria.cli.main", "run", f"{EXAMPLES / 'mlp.py'}:spec",
                  "--replicas", "2", "--steps", "12", "--run-dir", str(run_dir),
                  "--chaos", CHAOS, "--checkpoint-every", "none", "--no-resume")


def _once(lines: list[str], *patterns: str) -> None:
    for pattern in patterns:
        hits = [line for line in lines if re.search(pattern, line)]
        assert len(hits) == 1, (pattern, hits, lines)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_on_a_terminal_a_warning_prints_above_the_bar_and_each_line_once(tmp_path):
    shown = pieces(on_a_terminal(_run(tmp_path / "run")))
    warned = [i for i, p in enumerate(shown) if WARNING in p]
    assert len(warned) == 1, shown
    line = shown[warned[0]]
    # its own line: the log format from its first character, no piece of the bar before it
    assert re.match(r"\d\d:\d\d:\d\d WARNING ", line) and BAR not in line, line
    assert any(p.startswith("step ") and BAR in p and "/12" in p
               for p in shown[warned[0] + 1:]), "the bar is drawn again after the warning"
    assert not any(BAR in p and "WARNING" in p for p in shown)
    lines = [p for p in shown if BAR not in p]  # the bar's redraws are not lines
    _once(lines, r"^fault: w1 worker_lost at step \d+$", r"^w1 lost → 1 replicas in ",
          r"^run ok at step 12$", r"^done: 12 steps")
    assert not any("worker_lost: worker w1" in p for p in shown)  # the fault's log record


@pytest.mark.multiprocess
@pytest.mark.slow
def test_piped_each_status_and_recovery_line_prints_once(tmp_path):
    text = piped(_run(tmp_path / "run"))
    assert "\x1b" not in text and "\r" not in text
    lines = text.splitlines()
    _once(lines, r"^run: 12 steps on 2 replicas$", r"^fault: w1 worker_lost at step \d+$",
          r"^w1 lost → 1 replicas in ", r"WARNING .*" + re.escape(WARNING),
          r"^step 12/12 ", r"^run ok at step 12$", r"^done: 12 steps")
    # the controller's log record of the fault restates the display's fault line: left out
    assert "worker_lost: worker w1" not in text
