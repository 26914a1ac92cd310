"""docs/porting.md shows the porting examples as they are, and the ported script trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from planaria.examples.porting import PAIRS, diff

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "porting.md"


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_the_guide_shows_the_current_diff(name):
    text = GUIDE.read_text()
    assert f"<!-- diff:{name} -->\n```diff\n{diff(name)}```" in text, (
        "docs/porting.md is stale: paste `python -m planaria.examples.porting` into it")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_the_ported_ddp_script_trains(tmp_path):
    from planaria.cli.main import main

    script = Path(__file__).resolve().parents[1] / "examples" / "porting" / "ddp_after.py"
    assert main(["run", str(script), "--replicas", "2", "--steps", "4",
                 "--run-dir", str(tmp_path), "--checkpoint-every", "none", "--quiet"]) == 0
