"""The goodput bench's result, from its raw records alone (``bench/goodput.py``'s docstring
states the estimators; ``bench/stats.py`` the intervals).

:func:`summarize` reads nothing but the records it is given, so ``bench/goodput.py
--rescore`` and ``bench/make_benchmarks_md.py --rescore`` give the same JSON as the run
that wrote them.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from typing import Any

from bench import stats
from bench.goodput_figures import floor_figures, planaria_report, window_figures
from bench.goodput_parts import combine_parts
from planaria.observe.metrics import percentile

__all__ = ["GOODPUT_TARGET", "HEADLINE", "PEERS", "SPARES_SYSTEM", "run_figures", "summarize"]

HEADLINE = "planaria"
"""planaria's configuration for the ratios, fixed before the runs: no spare, every slot
trains (with a spare charged per provisioned slot, 3 replicas + 1 give up a quarter of the
slots, more than a spare can win back at these kill rates); the spare's run is reported
beside it, with its own ratios."""
SPARES_SYSTEM = "planaria_spares"
PEERS = ("torchft", "torchrun")
GOODPUT_TARGET = 0.985
FLOOR_POINTS = 0.01


def run_figures(raw: dict[str, Any]) -> dict[str, Any]:
    """One run's figures: the window's (``goodput_figures.window_figures``) and what its
    system adds (planaria's report and floor, torchrun's Young/Daly interval, torchft's
    replacements), each also per provisioned slot (x replicas ÷ slots)."""
    replicas = raw["replicas"]
    if "commits" not in raw:  # planaria's: its commits are its log's step_committed records
        raw = {**raw, "commits": [
            {"step": e["step"], "wall": e["t"], "width": e["width"],
             "started": e["t"] - e["duration_s"]}
            for e in raw.get("events") or [] if e["event"] == "step_committed"]}
    figures = window_figures(raw, replicas)
    share = replicas / raw.get("slots", replicas)
    for key in ("goodput", "samples_per_s"):
        value = figures[key]
        figures[f"{key}_per_slot"] = None if value is None else round(value * share, 4)
    system = raw["system"]
    if system.startswith("planaria"):
        figures["report"] = planaria_report(raw)
        figures.update(floor_figures(raw, figures["step_s_exact"]))
    elif system == "torchrun":
        save_s = percentile([ms / 1000 for ms in raw.get("ckpt_save_ms") or []], 0.5)
        figures["ckpt_save_s_p50"] = save_s
        figures["young_daly_ckpt_every"] = None
        if save_s is not None and figures["step_ms"] and raw.get("kill_every_s"):
            interval_s = (2 * save_s * raw["kill_every_s"]) ** 0.5
            figures["young_daly_ckpt_every"] = round(interval_s / (figures["step_ms"] / 1000), 1)
        figures["restarts"] = raw.get("restarts")
    elif system == "torchft":
        figures["replacements"] = len(raw.get("replacements") or [])
        figures["failed_iterations"] = raw.get("failed_iterations")
    figures.pop("step_s_exact", None)
    return figures


def _best_variant(runs: dict[str, dict[str, Any]]) -> str:
    """The variant (configuration) with the highest goodput per slot (no figure: last)."""
    return max(runs, key=lambda v: runs[v]["figures"]["goodput_per_slot"] or -1.0)


def _compact(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in figures.items() if not isinstance(v, list)}


def _median(values: list[Any]) -> float | None:
    xs = [v for v in values if v is not None]
    return round(statistics.median(xs), 4) if xs else None


def _one_of(raws: dict[str, dict[str, Any]], key: str) -> Any:
    """A field every record shares (the commit, the regime): its value, or the sorted set
    of values where they differ."""
    values = {json.dumps(r.get(key), sort_keys=True): r.get(key) for r in raws.values()}
    return next(iter(values.values())) if len(values) == 1 else [values[k] for k in
                                                                 sorted(values)]


def summarize(raws: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The bench's result (the Output shape of ``bench/goodput.py``'s docstring, with
    ``detail``) from raw records by name."""
    fault = {n: r for n, r in raws.items() if r.get("kind") == "faults"}
    control = {n: r for n, r in raws.items() if r.get("kind") == "control"}
    by_run = _by_run(fault)
    # A repeat missing a part (a sitting cut short) would not be like for like: left out.
    complete = {k: named for k, named in by_run.items() if len(named) == _parts_of(named)}
    incomplete = [f"{variant}-r{rep}: {len(named)} of {_parts_of(named)} parts"
                  for (system, rep, variant), named in by_run.items()
                  if (system, rep, variant) not in complete]
    repeats = sorted({rep for _, rep, _ in complete})
    # system -> repeat -> variant -> run (a repeat run in parts: its parts together)
    runs: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
    for (system, rep, variant), named in complete.items():
        figures = [run_figures(raw) for _, raw in named]
        runs.setdefault(system, {}).setdefault(rep, {})[variant] = {
            "name": named[0][0] if len(named) == 1 else f"{variant}-r{rep}",
            "raw": named[0][1],
            "figures": figures[0] if len(named) == 1 else combine_parts(figures)}
    chosen: dict[str, list[dict[str, Any] | None]] = {}
    for system, by_repeat in runs.items():
        chosen[system] = []
        for rep in repeats:
            variants = by_repeat.get(rep)
            chosen[system].append(variants[_best_variant(variants)] if variants else None)

    def series(system: str, key: str) -> list[Any]:
        return [None if c is None else c["figures"].get(key) for c in chosen.get(system, [])]

    def estimate(system: str, key: str) -> dict[str, Any]:
        return stats.median_ci(series(system, key)).as_dict()

    peers = [p for p in PEERS if p in chosen]
    best_peer = {key: [max((v for p in peers if (v := series(p, key)[i]) is not None),
                           default=None) for i in range(len(repeats))]
                 for key in ("goodput_per_slot", "samples_per_s_per_slot")}
    def ratios_of(system: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """``system``'s per-slot figures ÷ the best peer's, and ÷ each peer's, paired."""
        ratios: dict[str, Any] = {}
        per_peer: dict[str, Any] = {}
        if system in chosen:
            for key, label in (("goodput_per_slot", "goodput"),
                               ("samples_per_s_per_slot", "samples_per_s")):
                ours = series(system, key)
                ratios[label] = stats.paired_ratio(ours, best_peer[key])
                per_peer[label] = {p: stats.paired_ratio(ours, series(p, key)).as_dict()
                                   for p in peers}
        return ratios, per_peer

    def planaria_of(system: str) -> dict[str, Any]:
        """A planaria configuration's figures: medians over the repeats, and its targets."""
        if system not in chosen:
            return {}
        goodput = stats.median_ci(series(system, "goodput"))
        floor = _median(series(system, "floor"))
        return {
            "goodput": goodput.as_dict()["median"],
            "goodput_ci95": goodput.as_dict()["ci95"],
            "floor": floor,
            "samples_per_s": _median(series(system, "samples_per_s")),
            "lost_work_per_kill_steps": _median(series(system, "lost_work_per_kill_steps")),
            "goodput_per_slot": _median(series(system, "goodput_per_slot")),
            "samples_per_s_per_slot": _median(series(system, "samples_per_s_per_slot")),
            "ratio_uses": "per_slot",
            "targets": {
                f"goodput_ge_{GOODPUT_TARGET}": stats.met(goodput, GOODPUT_TARGET, ">="),
                "within_1pt_of_floor": None if goodput.median is None or floor is None
                or goodput.n < stats.MIN_FOR_CLAIM else goodput.median >= floor - FLOOR_POINTS,
            },
        }

    ratios, per_peer = ratios_of(HEADLINE)
    spares_ratios, spares_per_peer = ratios_of(SPARES_SYSTEM)

    def config_of(system: str) -> Any:
        picks = [c["raw"].get("config") for c in chosen[system] if c is not None]
        if not picks:
            return None
        counts = Counter(repr(p) for p in picks)
        return next(p for p in picks if repr(p) == counts.most_common(1)[0][0])

    out: dict[str, Any] = {
        "bench": "goodput",
        "regime": _one_of(raws, "regime"),
        "commit": _one_of(raws, "commit"),
        "planaria": planaria_of(HEADLINE),
        "planaria_spares": planaria_of(SPARES_SYSTEM),
        "peers": {p: {"config": config_of(p),
                      "goodput": _median(series(p, "goodput_per_slot")),
                      "goodput_ci95": estimate(p, "goodput_per_slot")["ci95"],
                      "samples_per_s": _median(series(p, "samples_per_s_per_slot"))}
                  for p in peers},
        "ratio_goodput_vs_best_peer": _ratio_json(ratios.get("goodput")),
        "ratio_samples_per_s_vs_best_peer": _ratio_json(ratios.get("samples_per_s")),
    }
    durations = {  # a repeat in parts: the parts' windows together
        f"{k}": {"duration_s": round(sum(float(r["duration_s"]) for _, r in named), 1)}
        for k, named in complete.items()}
    durations.update({n: {"duration_s": r.get("duration_s")} for n, r in control.items()})
    out["detail"] = {
        "repeats": repeats,
        "seeds": {str(rep): sorted({r["seed"] for r in fault.values() if r["repeat"] == rep})
                  for rep in repeats},
        "ratio_vs_each_peer": per_peer,
        "spares_ratio_goodput_vs_best_peer": _ratio_json(spares_ratios.get("goodput")),
        "spares_ratio_samples_per_s_vs_best_peer": _ratio_json(
            spares_ratios.get("samples_per_s")),
        "spares_ratio_vs_each_peer": spares_per_peer,
        "best_peer_per_repeat": "the highest per-slot figure among the peers in each repeat",
        "runs": {system: {str(rep): {v: {"name": run["name"],
                                         "commit": str(run["raw"].get("commit") or "")[:12],
                                         "cpu": (run["raw"].get("machine") or {}).get("cpu"),
                                         **_compact(run["figures"])}
                                    for v, run in runs[system].get(rep, {}).items()}
                          for rep in repeats} for system in runs},
        "chosen_variant": {s: [None if c is None else c["raw"]["variant"] for c in cs]
                           for s, cs in chosen.items()},
        "controls": {r["system"]: _control(r) for r in control.values()},
        "incomplete": incomplete,
        "setup": {**{k: _one_of(raws, k) for k in ("size", "replicas", "kill_every_s",
                                                   "global_batch", "command")},
                  "duration_s": _one_of(durations, "duration_s"),
                  "parts": _one_of(fault, "parts")},
    }
    return out


def _by_run(fault: dict[str, dict[str, Any]]
            ) -> dict[tuple[str, int, str], list[tuple[str, dict[str, Any]]]]:
    """The fault runs by (system, repeat, variant), each a list of (name, raw) in part
    order (one for a repeat not run in parts)."""
    out: dict[tuple[str, int, str], list[tuple[str, dict[str, Any]]]] = {}
    for name, raw in fault.items():
        out.setdefault((raw["system"], raw["repeat"], raw["variant"]), []).append((name, raw))
    for named in out.values():
        named.sort(key=lambda nr: int(nr[1].get("part") or 0))
    return out


def _parts_of(named: list[tuple[str, dict[str, Any]]]) -> int:
    """How many parts a run's records say it was cut in (1: not in parts)."""
    return int(named[0][1].get("parts") or 1)


def _ratio_json(estimate: stats.Estimate | None) -> dict[str, Any]:
    if estimate is None:
        return {"median": None, "ci95": None, "ahead": None, "n": 0}
    return {**estimate.as_dict(), "ahead": stats.ahead(estimate)}


def _control(raw: dict[str, Any]) -> dict[str, Any]:
    """A fault-free run's step rate, and the estimator read on it (near 1 when unbiased)."""
    figures = run_figures(raw)
    return {"variant": raw["variant"], "step_ms": figures["step_ms"],
            "samples_per_s": figures["samples_per_s"], "goodput": figures["goodput"],
            "window_s": figures["window_s"]}
