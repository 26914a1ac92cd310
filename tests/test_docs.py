"""The docs: field docs shown by ``help()``, and the site built strictly (a warning fails it)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pydoc
import subprocess
import sys
from pathlib import Path

import pytest

import planaria
from planaria.field_docs import document_fields, fields_section

ROOT = Path(__file__).resolve().parents[1]
CONFIG_CLASSES = [planaria.TrainSpec, planaria.RunConfig, planaria.CheckpointConfig]


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_help_shows_every_field_with_its_doc(cls):
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert "Fields" in text
    section = fields_section(cls)
    for f in dataclasses.fields(cls):
        assert f"\n{f.name}: " in section, f"{cls.__name__}.{f.name} has no doc under it"
    # Each doc as written under its field, first line included.
    assert "Train until this many steps are committed" in pydoc.render_doc(
        planaria.RunConfig, renderer=pydoc.plaintext)


def test_fields_keep_their_order_type_and_default():
    section = fields_section(planaria.CheckpointConfig)
    lines = section.splitlines()
    assert lines[:2] == ["Fields", "------"]
    assert lines[2] == "root: str | None = None"
    assert "keep_last: int | None = 3" in lines
    assert lines.index("root: str | None = None") < lines.index("keep_last: int | None = 3")


def test_a_class_without_source_keeps_its_docstring():
    cls = type("Made", (), {"__doc__": "Made at run time.", "__module__": "builtins"})
    assert document_fields(cls).__doc__ == "Made at run time."


# ~20 s of CPU (50 s on a loaded two-core machine): opt-in here; CI runs `mkdocs build --strict`.
@pytest.mark.extended
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None
                    or importlib.util.find_spec("mkdocstrings") is None,
                    reason='mkdocs is not installed (pip install -e ".[docs]")')
def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "WARNING" not in done.stdout + done.stderr
    assert (tmp_path / "site" / "api" / "config" / "index.html").is_file()
