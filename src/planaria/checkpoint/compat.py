"""Does a checkpoint fit the job: tensor names, shapes and dtypes, and the data plan."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["compare_data_plans", "compare_layouts"]

Layout = Mapping[str, tuple[tuple[int, ...], str]]
_SHOWN = 8  # names listed per kind of difference


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def compare_layouts(saved: Layout, live: Layout) -> list[str]:
    """What differs between a checkpoint's tensors and a replica's (name -> (shape, dtype
    name)), one line per kind, naming the tensors; [] if they match exactly."""
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    shapes = sorted(n for n in set(saved) & set(live) if tuple(saved[n][0]) != tuple(live[n][0]))
    dtypes = sorted(n for n in set(saved) & set(live) if saved[n][1] != live[n][1])
    out = []
    if missing:
        out.append(f"not in the checkpoint: {_names(missing)}")
    if unexpected:
        out.append(f"in the checkpoint but not in the job: {_names(unexpected)}")
    if shapes:
        out.append("shape differs: " + _names(
            [f"{n} (checkpoint {list(saved[n][0])}, job {list(live[n][0])})" for n in shapes]))
    if dtypes:
        out.append("dtype differs: " + _names(
            [f"{n} (checkpoint {saved[n][1]}, job {live[n][1]})" for n in dtypes]))
    return out


def compare_data_plans(saved: Mapping[str, Any] | None, live: Mapping[str, Any]) -> list[str]:
    """The fields of the data plan (dataset length, global batch, seed) that differ between
    a checkpoint's and the job's; [] if they match or the checkpoint recorded none."""
    if not isinstance(saved, Mapping):
        return []
    return [f"{k}: checkpoint {saved.get(k)!r}, job {live[k]!r}"
            for k in sorted(live) if k in saved and saved[k] != live[k]]
