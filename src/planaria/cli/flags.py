"""What every ``planaria`` subcommand shares: help that shows defaults, ``-v`` anywhere."""

from __future__ import annotations

import argparse

__all__ = ["HelpWithDefaults", "with_global_flags"]


class HelpWithDefaults(argparse.HelpFormatter):
    """Help that shows an option's default where it has one worth saying (not None or
    False) and its help does not say it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.option_strings and default not in (None, False, argparse.SUPPRESS)
                and "default" not in text and "%(default)" not in text):
            text += " (default: %(default)s)"
        return text


def with_global_flags(parser: argparse.ArgumentParser) -> None:
    """``-v`` also after a subcommand (``planaria run -v ...``), on every parser below
    ``parser``; each shows its defaults."""
    for action in parser._actions:  # argparse's public way to walk subcommands has none
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.formatter_class = HelpWithDefaults
                if "-v" not in child._option_string_actions:
                    child.add_argument("-v", "--verbose", action="count",
                                       default=argparse.SUPPRESS,
                                       help="more logging (-vv: debug)")
                with_global_flags(child)
