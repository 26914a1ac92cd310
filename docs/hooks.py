"""mkdocs hook: ``<!-- planaria-cli-help -->`` in a page becomes the CLI's ``--help`` texts.

The help is taken from the installed command itself at build time, so the page cannot go
stale. Commands whose help is shown: the top level and every subcommand.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

MARKER = "<!-- planaria-cli-help -->"
COMMANDS = [[], ["run"], ["demo"], ["report"], ["plan"], ["campaign"], ["node-drain-hook"],
            ["ckpt", "ls"], ["ckpt", "verify"], ["ckpt", "export"]]


def _help(args: list[str]) -> str:
    from planaria.cli.main import main

    out = io.StringIO()
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*args, "--help"])
    return out.getvalue().rstrip()


def on_page_markdown(markdown: str, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    sections = [f"## `planaria {' '.join(args)}`\n\n```text\n{_help(args)}\n```\n"
                for args in COMMANDS]
    return markdown.replace(MARKER, "\n".join(sections))
