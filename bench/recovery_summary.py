"""The recovery bench's paired figures, from its raw per-run records alone
(``bench/recovery.py``'s docstring states them; ``bench/stats.py`` the intervals).

Each raw record is one kill run of one system in one repeat: the runner's figures
(``recover_s``, ``back_s``, ``lost_steps``, ...) with ``system``, ``repeat``, ``seed`` and
``config``. Per system the run with the median ``back_s`` is shown (its other figures its
own); the speed-ups are the median of the per-repeat ratios ``peer back_s ÷ planaria
back_s`` with the paired bootstrap interval, "ahead" only where its low end is above 1.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from bench import stats
from bench.goodput_figures import lost_share

__all__ = ["SYSTEMS", "lost_work_per_kill", "summarize"]

SYSTEMS = ("planaria", "torchrun", "torchft")


def lost_work_per_kill(raw: dict[str, Any]) -> float | None:
    """The share of a step lost (``goodput_figures.lost_share``: ``(redone - unstarted) /
    total`` micro-batches) of the first ``step_resumed`` record after the kill; None where
    the run logged none (one kill: not measured)."""
    resumed = raw.get("step_resumed") or []
    first = resumed[0] if resumed else None
    return lost_share(first) if first and first.get("total") else None


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose back_s is the median of the repeats (its other figures stay its own)."""
    done = sorted((r for r in runs if r.get("back_s") is not None), key=lambda r: r["back_s"])
    chosen = dict(done[(len(done) - 1) // 2] if done else runs[0])
    chosen["back_s_all"] = [r.get("back_s") for r in runs]
    return chosen


def _one_of(raws: dict[str, dict[str, Any]], key: str) -> Any:
    values = {json.dumps(r.get(key), sort_keys=True): r.get(key) for r in raws.values()}
    return next(iter(values.values())) if len(values) == 1 else [values[k] for k in
                                                                 sorted(values)]


def summarize(raws: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The paired part of ``bench/recovery.py``'s result from raw records by name."""
    repeats = sorted({r["repeat"] for r in raws.values()})
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for raw in raws.values():
        by.setdefault(raw["system"], {})[raw["repeat"]] = raw

    def back(system: str) -> list[float | None]:
        return [(by.get(system, {}).get(rep) or {}).get("back_s") for rep in repeats]

    out: dict[str, Any] = {"bench": "recovery", "commit": _one_of(raws, "commit"),
                           "repeat": len(repeats),
                           "seeds": [by_rep.get("seed") for by_rep in
                                     (next((by[s][rep] for s in by if rep in by[s]), {})
                                      for rep in repeats)]}
    keep = ("recover_s", "back_s", "lost_steps", "join_s", "detect_s", "replacement_s",
            "step_ms_median", "victim", "kill_at_step", "resume_step", "phases_s", "rejoin_s",
            "failed_steps", "config", "config_applied")
    for system in SYSTEMS:
        if system not in by:
            continue
        runs = [by[system][rep] for rep in repeats if rep in by[system]]
        median_run = _median_run(runs)
        row = {k: median_run.get(k) for k in keep if k in median_run}
        row["step_ms"] = row.pop("step_ms_median", None)
        row["back_s_all"] = median_run["back_s_all"]
        row["back_s_median_ci95"] = stats.median_ci(back(system)).as_dict()
        if system == "planaria":
            lost = [lost_work_per_kill(r) for r in runs]
            measured = [x for x in lost if x is not None]
            row["lost_work_per_kill_steps"] = (round(statistics.median(measured), 4)
                                               if measured else None)
            row["lost_work_per_kill_steps_all"] = lost
            row["replicas"] = median_run.get("replicas")
        out[system] = row
    for peer in ("torchrun", "torchft"):
        if peer in by and "planaria" in by:
            est = stats.paired_ratio(back(peer), back("planaria"))
            out[f"speedup_vs_{peer}"] = est.median
            out[f"speedup_vs_{peer}_ci95"] = est.as_dict()["ci95"]
            out[f"speedup_vs_{peer}_ahead"] = stats.ahead(est)
    return out
