"""The examples the README points to run as it says, with a kill."""

from __future__ import annotations

from pathlib import Path

import pytest

from planaria.cli.main import main
from tests.assertions import events, of

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def test_the_custom_step_example_runs_through_a_kill(tmp_path):
    assert main(["run", str(EXAMPLES / "custom_step.py"), "--replicas", "2", "--steps", "6",
                 "--run-dir", str(tmp_path), "--checkpoint-every", "none", "--quiet",
                 "--chaos", "kill:w1@step2"]) == 0
    evs = events(tmp_path)
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_lost"]
    assert [e["step"] for e in of(evs, "step_committed")][-1] == 5
    assert all("penalty" in e["metrics"] for e in of(evs, "step_committed"))


def test_the_torchtitan_example_runs_through_a_kill(tmp_path):
    pytest.importorskip("torchtitan")
    from planaria.examples import torchtitan_llama

    result = torchtitan_llama.main(["--replicas", "2", "--steps", "6", "--run-dir",
                                    str(tmp_path), "--chaos", "kill:w1@step2"])
    assert result.final_step == 6
    evs = events(tmp_path)
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_lost"]
    assert [e["step"] for e in of(evs, "step_committed")][-1] == 5
