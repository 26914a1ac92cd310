"""A repeat run in parts (``bench/goodput.py --parts``): one system's figures for the whole
repeat from its parts' figures, as if its parts were one window.

Each part is a run of its own (a fresh job, its window opening after its warm-up), so a
figure of the whole is built from the parts' figures by what the figure is:

- counts add up (useful steps, kills, recoveries, ...), and so do the windows;
- a share or a rate of the window (goodput, samples/s, the floor) is the parts' mean
  weighted by their windows: ``sum(useful steps x step time) / sum(windows)`` is exactly
  the window-weighted mean of the parts' goodputs, and ``1 - sum(kills x parts) /
  sum(windows)`` that of their floors;
- a mean per useful step (``step_ms``) is weighted by useful steps; a mean per kill (lost
  work, the floor's parts) by kills;
- percentiles over kills (MTTR, back at full width, recover) are taken again over every
  part's kills together;
- what is left (planaria's own report's times, the step time by width, torchrun's save
  time) is the parts' mean weighted by their windows: detail, not a figure with a target.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planaria.observe.metrics import percentile

__all__ = ["combine_parts"]

_SUMS = {"useful_steps", "steps_committed", "lost_steps", "recoveries", "kills",
         "skipped_kills", "window_s", "replacements", "failed_iterations", "restarts",
         "faults", "faults_recovered", "spares_taken", "joins"}
_BY_USEFUL_STEPS = {"step_ms"}
_BY_KILLS = {"lost_work_per_kill_steps", "detect_s", "lost_work_s", "transfer_stall_s"}
_PERCENTILES = {"mttr_s": ("mttr_s_p50", "mttr_s_p99"),
                "full_width_s": ("full_width_s_p50", "full_width_s_p99"),
                "recover_s": ("recover_s_p50", "recover_s_p99")}
_DIGITS = {"window_s": 1, "useful_steps_per_s": 3, "samples_per_s": 3, "step_ms": 2}


def _weighted(values: list[Any], weights: list[float], digits: int) -> float | None:
    pairs = [(float(v), w) for v, w in zip(values, weights, strict=True)
             if isinstance(v, int | float) and not isinstance(v, bool)]
    total = sum(w for _, w in pairs)
    if not pairs or total <= 0:
        return None
    return round(sum(v * w for v, w in pairs) / total, digits)


def _combine(parts: list[dict[str, Any]], weight_of: Callable[[str], list[float]]
             ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        values = [p.get(key) for p in parts]
        present = [v for v in values if v is not None]
        if not present:
            out[key] = None
        elif all(isinstance(v, list) for v in present):
            out[key] = [x for v in present for x in v]
        elif all(isinstance(v, dict) for v in present):
            out[key] = _combine([v if isinstance(v, dict) else {} for v in values], weight_of)
        elif key in _SUMS:
            out[key] = sum(present)
        elif all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
            out[key] = _weighted(values, weight_of(key), _DIGITS.get(key, 4))
        else:  # a label (a commit, a name): the first part's
            out[key] = present[0]
    return out


def combine_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's figures for a repeat from its parts' figures (``run_figures`` of each,
    in part order), by the rules of the module docstring; ``parts`` is how many there
    were."""
    windows = [float(p.get("window_s") or 0.0) for p in parts]
    useful = [float(p.get("useful_steps") or 0) for p in parts]
    kills = [float(p.get("kills") or 0) for p in parts]

    def weight_of(key: str) -> list[float]:
        if key in _BY_USEFUL_STEPS:
            return useful
        if key in _BY_KILLS:
            return kills
        return windows

    out = _combine(parts, weight_of)
    for series, (p50, p99) in _PERCENTILES.items():
        if series in out and isinstance(out[series], list):
            found = [float(v) for v in out[series] if v is not None]
            for key, q in ((p50, 0.5), (p99, 0.99)):
                value = percentile(found, q)
                out[key] = None if value is None else round(value, 4)
    out["parts"] = len(parts)
    return out
