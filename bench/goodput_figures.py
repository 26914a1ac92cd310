"""The figures of one goodput run, from its raw record alone (``bench/goodput.py``'s
docstring defines them): useful steps, the per-stretch fault-free step time, goodput,
samples per second, per-kill recovery times; for planaria, its own accounting, the
detection time seen from outside, the work lost per kill and the floor its measured parts
set. Pure functions of the record: ``bench/goodput.py --rescore`` recomputes them.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from bench.common import GLOBAL_BATCH
from planaria.observe.metrics import percentile, summarize

__all__ = [
    "MIN_STEADY_GAPS",
    "SETTLE_S",
    "detect_from_outside",
    "floor_figures",
    "lost_share",
    "lost_work_per_kill",
    "per_kill",
    "planaria_report",
    "spare_starts",
    "step_ms_by_width",
    "stretch_step_s",
    "transfer_stall_s",
    "window_figures",
]

MIN_STEADY_GAPS = 5
SETTLE_S = 10.0



def _by_wall(commits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(commits, key=lambda c: c["wall"])


def _timed_gaps(commits: list[dict[str, Any]], keep: Callable[[dict, dict], bool]
                ) -> list[tuple[float, float]]:
    """(end, gap) between commits of consecutive steps (in wall order) that ``keep``
    accepts."""
    return [(b["wall"], b["wall"] - a["wall"]) for a, b in itertools.pairwise(commits)
            if b["step"] == a["step"] + 1 and keep(a, b)]


def _gaps(commits: list[dict[str, Any]], keep: Callable[[dict, dict], bool]) -> list[float]:
    """The gaps alone of :func:`_timed_gaps`."""
    return [gap for _, gap in _timed_gaps(commits, keep)]


def _kill_near(a: dict, b: dict, kills: list[float], settle_s: float = 0.0) -> bool:
    """A kill between commits a and b, or in the ``settle_s`` before a."""
    return any(a["wall"] - settle_s < k <= b["wall"] for k in kills)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def spare_starts(run: dict[str, Any]) -> list[tuple[float, float]]:
    """(requested, set up) of every hot spare the run started: from planaria's
    ``spare_requested`` to its ``worker_started`` or ``spare_ready``, whichever came first
    (a spare still starting when a kill took it as the replacement has no ``spare_ready``);
    one set up after the record's end: to its end."""
    events = run.get("events") or []
    done: dict[str, float] = {}
    for e in events:
        if e.get("event") in ("worker_started", "spare_ready"):
            done[e["worker"]] = min(e["t"], done.get(e["worker"], e["t"]))
    return [(e["t"], done.get(e["worker"], float("inf"))) for e in events
            if e.get("event") == "spare_requested"]


def _starting(a: dict, b: dict, starts: Sequence[tuple[float, float]]) -> bool:
    """A spare starting at some time between commits a and b."""
    return any(begin < b["wall"] and end > a["wall"] for begin, end in starts)


def _steady_gaps(window: list[dict[str, Any]], kills: list[float], replicas: int,
                 starts: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """(end, gap) of consecutive full-width commits away from kills: none between them,
    none in the ``SETTLE_S`` before (the recovery, and the replacement that starts then),
    no spare starting between them (a fault-free run starts none: its CPU, on cores the
    workers share, slows the steps beside it, a cost of the kill that used the last one);
    with fewer than ``MIN_STEADY_GAPS`` of those, no kill between them."""
    for settle_s in (SETTLE_S, 0.0):
        steady = _timed_gaps(window, lambda a, b, s=settle_s: (
            a["width"] >= replicas and b["width"] >= replicas
            and not _kill_near(a, b, kills, s) and not (s and _starting(a, b, starts))))
        if len(steady) >= MIN_STEADY_GAPS:
            break
    return steady


def stretch_step_s(window: list[dict[str, Any]], kills: list[float], replicas: int,
                   starts: Sequence[tuple[float, float]] = ()) -> list[float] | None:
    """The fault-free step time of each stretch of the window between kills (one more
    than there are kills): the mean of its steady gaps, or of the whole window's where a
    stretch has fewer than ``MIN_STEADY_GAPS``; None without steady gaps.

    The mean, not the median: the time a run needs for n steps is n times the mean gap,
    and a system whose gaps are skewed (planaria's 3 workers on 2 cores: mean/median
    1.02, against 1.005 for torchft's slower steps) read ~0.98 for a run with no fault
    at all against a median. Per stretch, not one figure for the window: this machine's
    speed drifts by a few percent over ten minutes, and one baseline for the window
    charges the slow stretches' steps too little and the fast ones' too much (a run
    that sped up after its first kill read 1.005 with its first 30 s as baseline). Not
    a window sliding across kills either: its commits are denser where steps are fast,
    which weighs a fast stretch's steps with its slower neighbours' gaps (that read a
    run that sped up at a kill above 1)."""
    steady = _steady_gaps(window, kills, replicas, starts)
    pooled = _mean([gap for _, gap in steady])
    if pooled is None:
        return None
    bounds = sorted(kills)
    stretches: list[list[float]] = [[] for _ in range(len(bounds) + 1)]
    for end, gap in steady:
        stretches[bisect.bisect_left(bounds, end)].append(gap)
    return [sum(gaps) / len(gaps) if len(gaps) >= MIN_STEADY_GAPS else pooled
            for gaps in stretches]


def step_ms_by_width(window: list[dict[str, Any]], kills: list[float]) -> dict[str, float]:
    """Mean step time at each width (consecutive commits at that width, no kill between)."""
    out: dict[str, float] = {}
    for width in sorted({c["width"] for c in window}):

        def at_width(a: dict, b: dict, w: int = width) -> bool:
            return a["width"] == w == b["width"] and not _kill_near(a, b, kills)

        gaps = _gaps(window, at_width)
        if gaps:
            out[str(width)] = round((_mean(gaps) or 0.0) * 1000, 2)
    return out


def per_kill(commits: list[dict[str, Any]], t_kill: float, replicas: int) -> dict[str, Any]:
    """recover_s, back_s (MTTR), full_width_s of one kill, from the window's commits.

    A step that was running at the kill and still committed (every all-reduce of it
    was done: the kill came after) is progress made before the fault: it counts
    in ``s_max``, and only steps begun after the kill count as recovered ones.
    """
    s_max = max((c["step"] for c in commits if c["started"] <= t_kill), default=-1)
    after = [c for c in commits if c["started"] > t_kill]
    beyond = next((c for c in after if c["step"] > s_max), None)
    full = next((c for c in after if c["width"] >= replicas), None)
    return {
        "s_max": s_max,
        "recover_s": after[0]["wall"] - t_kill if after else None,
        "back_s": beyond["wall"] - t_kill if beyond else None,
        "full_width_s": full["wall"] - t_kill if full else None,
    }


def _p(values: list[float | None], q: float) -> float | None:
    found = [v for v in values if v is not None]
    value = percentile(found, q)
    return None if value is None else round(value, 4)


def window_figures(run: dict[str, Any], replicas: int) -> dict[str, Any]:
    """The figures of the module docstring from a runner's raw records."""
    t0, t1 = run["t0"], run["t1"]
    commits = _by_wall(run["commits"])
    window = [c for c in commits if t0 < c["wall"] <= t1]
    kills = [k["t_kill"] for k in run["kills"] if t0 <= k["t_kill"] <= t1]
    high = max((c["step"] for c in commits if c["wall"] <= t0), default=-1)
    per_stretch = stretch_step_s(window, kills, replicas, spare_starts(run))
    bounds = sorted(kills)
    useful = lost = 0
    needed = 0.0  # the fault-free time of the useful steps: each at its stretch's step time
    for c in window:
        if c["step"] > high:
            useful, high = useful + 1, c["step"]
            if per_stretch:
                needed += per_stretch[bisect.bisect_left(bounds, c["wall"])]
        else:
            lost += 1
    step_s = needed / useful if useful and per_stretch else None
    span = t1 - t0
    rows = [per_kill(window, t, replicas) for t in kills]
    back = [r["back_s"] for r in rows]
    full = [r["full_width_s"] for r in rows]
    recover = [r["recover_s"] for r in rows]
    return {
        "goodput": round(needed / span, 4) if step_s else None,
        "useful_steps": useful,
        "steps_committed": len(window),
        "lost_steps": lost,
        "recoveries": sum(b is not None for b in back),
        "kills": len(kills),
        "skipped_kills": len(run.get("skipped_kills") or []),
        "mttr_s_p50": _p(back, 0.5),
        "mttr_s_p99": _p(back, 0.99),
        "full_width_s_p50": _p(full, 0.5),
        "full_width_s_p99": _p(full, 0.99),
        "recover_s_p50": _p(recover, 0.5),
        "recover_s_p99": _p(recover, 0.99),
        "step_ms": round(step_s * 1000, 2) if step_s else None,
        "step_ms_by_width": step_ms_by_width(window, kills),
        "useful_steps_per_s": round(useful / span, 3),
        "samples_per_s": round(useful * (run.get("global_batch") or GLOBAL_BATCH) / span, 3),
        "step_s_exact": step_s,
        "window_s": round(span, 1),
        "mttr_s": [None if b is None else round(b, 3) for b in back],
        "recover_s": [None if r is None else round(r, 3) for r in recover],
        "full_width_s": [None if f is None else round(f, 3) for f in full],
        "kill_log": [{"at_s": round(k["t_kill"] - t0, 2), "worker": k["worker"]}
                     for k in run["kills"]],
    }


def detect_from_outside(run: dict[str, Any]) -> list[float | None]:
    """Per kill: the harness's SIGKILL → planaria's ``fault`` record naming the victim."""
    faults = [e for e in run["events"] if e["event"] == "fault"]
    out: list[float | None] = []
    for kill in run["kills"]:
        seen = next((e["t"] for e in faults if e["t"] >= kill["t_kill"]
                     and kill["worker"] in str(e.get("worker", "")).split(",")), None)
        out.append(None if seen is None else seen - kill["t_kill"])
    return out


def planaria_report(run: dict[str, Any]) -> dict[str, Any]:
    """planaria's own accounting (``summarize``) over the window's records of its log, and
    its detection time measured from the harness's kills. (``summarize``'s detect_s and
    recover_s start at the fault's ``fault_t``, planaria's own estimate of when it
    happened, not at the kill.)"""
    records = [e for e in run["events"] if run["t0"] <= float(e["t"]) <= run["t1"]]
    s = summarize(records)
    recovered = [f for f in s.faults if f.recovered]
    detect = detect_from_outside(run)
    return {
        "detect_s_p50": _p(detect, 0.5),
        "detect_s_p99": _p(detect, 0.99),
        "goodput_time_based": round(s.goodput, 4),
        "badput": {k: round(v, 4) for k, v in s.badput.items() if v},
        "faults": len(s.faults),
        "faults_recovered": len(recovered),
        "own_recover_s_p50": s.recover_s.p50,
        "own_detect_s_p50": s.detect_s.p50,
        "spares_taken": sum(1 for e in records if e["event"] == "replacement_requested"
                            and e.get("spare")),
        "joins": sum(1 for e in records if e["event"] == "joined"),
    }



def _window_events(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in run.get("events") or [] if run["t0"] <= float(e["t"]) <= run["t1"]]


def _window_kills(run: dict[str, Any]) -> list[float]:
    return sorted(k["t_kill"] for k in run["kills"] if run["t0"] <= k["t_kill"] <= run["t1"])


def lost_share(resumed: dict[str, Any]) -> float:
    """A ``step_resumed`` record's share of a step lost: ``(redone - unstarted) / total``
    (records from before ``unstarted`` was logged: ``redone / total``, an upper bound)."""
    lost = float(resumed["redone"]) - float(resumed.get("unstarted") or 0)
    return lost / float(resumed["total"])


def lost_work_per_kill(run: dict[str, Any]) -> float | None:
    """The mean over the window's kills of the share of a step lost: ``(redone -
    unstarted) / total`` micro-batches of the first ``step_resumed`` record between the kill
    and the next one (the micro-batches computed again less those a survivor had not begun:
    the dead ranks' share, an upper bound; records without ``unstarted``, older ones, count
    every redone one), 0 where none came (the step had committed). None where the run
    logged no ``step_resumed`` at all (not measured: a planaria without it), or had no
    kill."""
    resumed = [e for e in run.get("events") or [] if e["event"] == "step_resumed"]
    kills = _window_kills(run)
    if not resumed or not kills:
        return None
    shares = []
    for i, t_kill in enumerate(kills):
        until = kills[i + 1] if i + 1 < len(kills) else float("inf")
        first = next((e for e in resumed if t_kill <= float(e["t"]) < until), None)
        total = first and first.get("total")
        shares.append(lost_share(first) if first and total else 0.0)
    return sum(shares) / len(shares)


def transfer_stall_s(run: dict[str, Any], step_s: float | None = None) -> float:
    """The seconds the survivors waited in the window for joiners' state transfers: the
    ``state_transfer`` records' own seconds (planaria sends the state while building the
    joiners' generation, the survivors stopped at the step boundary). A transfer
    ``beside`` the step (its record's seconds: the model's part alone) also charges what
    the generation's first step took over ``step_s`` (the fault-free step): the joiner
    waits for the rest before the reduction, and the survivors with it."""
    commits = sorted(c["wall"] for c in run.get("commits") or [])
    total = 0.0
    for e in _window_events(run):
        if e["event"] != "state_transfer":
            continue
        total += float(e.get("seconds") or 0.0)
        if e.get("beside") and step_s is not None:
            after = commits[bisect.bisect_right(commits, float(e["t"])):]
            if after:
                total += max(0.0, after[0] - float(e["t"]) - step_s)
    return total


def floor_figures(run: dict[str, Any], step_s: float | None) -> dict[str, Any]:
    """planaria's floor, ``1 - kills x (detect + lost work + transfer stall) / window``,
    from its measured parts (each a mean per kill): ``detect_s`` the harness's SIGKILL →
    planaria's ``fault`` record, lost work ``lost_work_per_kill_steps x`` the fault-free
    step time, ``transfer_stall_s`` the window's state transfers (:func:`transfer_stall_s`) over its
    kills. None
    where a part was not measured (no kill, no ``step_resumed`` record)."""
    kills = _window_kills(run)
    detects = [d for d in detect_from_outside(run) if d is not None]
    lost_steps = lost_work_per_kill(run)
    parts: dict[str, float | None] = {
        "detect_s": sum(detects) / len(detects) if detects else None,
        "lost_work_s": None if lost_steps is None or step_s is None else lost_steps * step_s,
        "transfer_stall_s": transfer_stall_s(run, step_s) / len(kills) if kills else None,
    }
    span = run["t1"] - run["t0"]
    known = [v for v in parts.values() if v is not None]
    floor = (1.0 - len(kills) * sum(known) / span) if kills and len(known) == len(parts) \
        else None
    return {"floor": None if floor is None else round(floor, 4), "kills": len(kills),
            "lost_work_per_kill_steps": None if lost_steps is None else round(lost_steps, 4),
            "floor_parts_s": {k: None if v is None else round(v, 4) for k, v in parts.items()}}
