"""``fit()`` draws planaria's progress bar when stdout is a terminal, with the user's log
records above it and a summary line at the end; piped, its output stays plain."""

from __future__ import annotations

import re
import textwrap

import pytest

from tests.cli.terminal import on_a_terminal, pieces, piped, python

SCRIPT = textwrap.dedent('''
    import logging, sys
    logging.basicConfig(format="%(levelname)s %(name)s %(message)s")  # the user's handler
    from planaria import fit
    from planaria.examples.mlp import spec

    def on_step(step):
        if step.step == 5:
            logging.getLogger("user").warning("halfway there")

    result = fit(spec, steps=12, replicas=2, run_dir=sys.argv[1], on_step=on_step)
    print("final step", result.final_step)
''')
BAR = "━"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fit_on_a_terminal_draws_the_bar_and_a_summary_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    shown = pieces(on_a_terminal(python(str(script), str(tmp_path / "run"))))
    assert any(p.startswith("step ") and BAR in p and "12/12" in p for p in shown), shown
    warned = [p for p in shown if "halfway there" in p]
    assert warned == ["WARNING user halfway there"], shown  # its own line, above the bar
    summary = [p for p in shown if p.startswith("run ok: ")]
    assert len(summary) == 1 and re.match(r"run ok: 12 steps in [\d.]+ s, 0 faults", summary[0])
    assert "final step 12" in shown


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fit_piped_stays_plain(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    text = piped(python(str(script), str(tmp_path / "run")))
    assert "\x1b" not in text and "\r" not in text and BAR not in text
    assert "WARNING user halfway there" in text and "final step 12" in text
    assert not re.search(r"^(step \d+/|run ok)", text, re.M)  # no display unless asked
