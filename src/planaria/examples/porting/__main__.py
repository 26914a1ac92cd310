"""Prints the diffs docs/porting.md shows."""

from planaria.examples.porting import PAIRS, diff

for name in PAIRS:
    print(f"<!-- diff:{name} -->\n```diff\n{diff(name)}```\n")
