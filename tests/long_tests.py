"""Rewrites ``tests/long_tests.txt``: the tests of the default suite that take long.

Run the default suite with every test's time, then give the log to this script::

    python -m pytest -q -p no:cacheprovider --durations=0 --durations-min=1 | tee times.log
    python tests/long_tests.py times.log            # threshold: 10 s, or --min SECONDS

A test whose setup, call and teardown add up to at least the threshold is listed; the
suite's conftest marks the listed tests ``long``, which the default run leaves out (it
stays under 15 minutes on two cores) and ``.ci/run`` runs after it (``-m long``).
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

LIST = Path(__file__).with_name("long_tests.txt")
_LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+::\S+)")
HEADER = """\
# Tests of more than ~10 s each (setup + call + teardown, timed on two cores), marked
# `long` by tests/conftest.py: `python -m pytest` leaves them out, `.ci/run` runs them after
# the default suite (`python -m pytest -m long`). Regenerate: `python tests/long_tests.py LOG`.
"""


def long_tests(log: str, minimum: float) -> list[str]:
    """The test ids of ``log`` (pytest's ``--durations`` lines) taking ``minimum`` s or more."""
    total: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        m = _LINE.match(line)
        if m:
            total[m.group(3)] += float(m.group(1))
    return sorted(t for t, s in total.items() if s >= minimum)


def read_list(path: Path = LIST) -> frozenset[str]:
    """The ids listed in ``path`` (comments and blank lines left out)."""
    if not path.exists():
        return frozenset()
    return frozenset(line.strip() for line in path.read_text().splitlines()
                     if line.strip() and not line.startswith("#"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="the output of a pytest run with --durations=0")
    parser.add_argument("--min", type=float, default=10.0, help="seconds (default: 10)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the tests already listed that the log does not time")
    args = parser.parse_args()
    ids = set(long_tests(Path(args.log).read_text(errors="replace"), args.min))
    if args.keep:
        ids |= read_list()
    LIST.write_text(HEADER + "".join(f"{t}\n" for t in sorted(ids)))
    print(f"{len(ids)} long tests in {LIST}")


if __name__ == "__main__":
    main()
