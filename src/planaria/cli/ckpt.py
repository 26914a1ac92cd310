"""``planaria ckpt ls|verify|export``: the command-line side of
:mod:`planaria.checkpoint.cli`."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["MissingPath", "ckpt_main"]


class MissingPath(Exception):
    """A path given on the command line that does not exist (exit status 2)."""


def _must_exist(path: str, what: str, options: dict[str, Any]) -> None:
    from planaria.checkpoint.storage import Storage

    st = Storage(path, options)
    if not st.exists(st.root):
        raise MissingPath(f"{what} {path} does not exist")


def ckpt_main(args: argparse.Namespace) -> int:
    from planaria.checkpoint import cli as ck
    from planaria.cli.run_dir import storage_options

    options = storage_options(args.storage_option)
    _must_exist(args.run_dir if args.ckpt_command == "ls" else args.path,
                "the run directory (or checkpoint root)" if args.ckpt_command == "ls"
                else "the checkpoint", options)
    if args.ckpt_command == "ls":
        rows = ck.ls(args.run_dir, verify=True, storage_options=options)
        if args.json:
            print(json.dumps(rows, default=str))
            return 0
        from rich.console import Console
        from rich.table import Table

        table = Table("step", "size (MB)", "committed", "verified", "path")
        for row in rows:
            table.add_row(
                str(row.get("step")),
                f"{(row.get('bytes') or 0) / 1e6:.1f}",
                str(row.get("committed")),
                str(row.get("verified")),
                str(row.get("path")),
            )
        Console().print(table)
        return 0
    if args.ckpt_command == "verify":
        report = ck.verify(args.path, storage_options=options)
        print(json.dumps(report, indent=2, default=str))
        return 0 if report.get("ok") else 1
    if args.ckpt_command == "export":
        info = ck.export(args.path, args.out, storage_options=options)
        print(json.dumps(info, indent=2, default=str))
        return 0
    return 2
