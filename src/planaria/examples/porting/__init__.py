"""Scripts as users write them and their planaria versions, shown side by side as diffs in
``docs/porting.md`` (``python -m planaria.examples.porting`` prints them)."""

from __future__ import annotations

import difflib
from pathlib import Path

__all__ = ["PAIRS", "diff"]

HERE = Path(__file__).parent

PAIRS = {"ddp": ("ddp_before.py", "ddp_after.py"), "hf": ("hf_before.py", "hf_after.py")}
"""Name -> (before, after) file names in this folder."""


def diff(name: str) -> str:
    """The unified diff of pair ``name``, as docs/porting.md shows it."""
    before, after = PAIRS[name]
    return "".join(difflib.unified_diff(
        (HERE / before).read_text().splitlines(keepends=True),
        (HERE / after).read_text().splitlines(keepends=True),
        fromfile=before, tofile=after))
