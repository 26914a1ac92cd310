"""Where each rank's step time went, from the ``ranks`` of the ``step_committed`` records.

A record's ``ranks`` (:meth:`planaria.wire.reports.RankTimes.to_json`) holds, per part
(:data:`PARTS`), a list of seconds in rank order from rank ``first`` (0 when absent),
null where not known. :func:`summarize_ranks` averages them per rank over the steps run
at the run's last width (a rank is a worker of a generation: the last generation's
names it); the rank with the most own work (load and compute) is the one the others wait
for, and their reduce-wait shows it. :func:`rank_scalars` is what trackers log of one
record. Logs written before records carried ``ranks`` have none: no summary.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from planaria.observe.segments import num

__all__ = ["PARTS", "TRACKED_RANKS", "RankMeans", "RankSummary", "rank_scalars",
           "record_ranks", "summarize_ranks"]

PARTS = ("load", "compute", "reduce_wait", "apply")
"""A rank's step time, in parts: waiting for or loading its samples, forward and backward,
blocked in the gradient's all-reduce, the optimizer step and bookkeeping."""
TRACKED_RANKS = 8
"""Trackers get every rank's times up to this width; beyond it, each part's max and min
over the ranks a step carries and the rank of the max (bounded series for wide jobs)."""


def record_ranks(record: Mapping[str, Any]) -> Iterator[tuple[int, dict[str, float | None]]]:
    """``(rank, {part: seconds or None})`` of each rank a record carries (none if it has no
    ``ranks``)."""
    raw = record.get("ranks")
    if not isinstance(raw, Mapping):
        return
    first = int(num(raw.get("first")) or 0)
    lists: dict[str, list[Any]] = {}
    for part in PARTS:
        values = raw.get(part)
        lists[part] = values if isinstance(values, list) else []
    for i in range(max(len(v) for v in lists.values())):
        yield first + i, {part: num(v[i]) if i < len(v) else None for part, v in lists.items()}


@dataclass(frozen=True, kw_only=True)
class RankMeans:
    """One rank's mean seconds per step of each part (None: never known), over ``steps``."""

    rank: int
    worker: str | None
    steps: int
    load: float | None
    compute: float | None
    reduce_wait: float | None
    apply: float | None

    @property
    def own_s(self) -> float:
        """Its own work per step: load and compute (what the others wait for)."""
        return (self.load or 0.0) + (self.compute or 0.0)


@dataclass(frozen=True, kw_only=True)
class RankSummary:
    """Every rank's means at the run's last width, and the rank that holds the others back:
    the one with the most own work (``slowest``), with the part where it loses most
    (``slowest_part``: load or compute)."""

    width: int
    ranks: list[RankMeans] = field(default_factory=list)
    slowest: int | None = None
    slowest_worker: str | None = None
    slowest_part: str | None = None


def summarize_ranks(events: Sequence[Mapping[str, Any]]) -> RankSummary | None:
    """The per-rank summary of a run's records (None: no record carries ``ranks``)."""
    carrying = [e for e in events if e.get("event") == "step_committed" and "ranks" in e]
    if not carrying:
        return None
    width = int(num(carrying[-1].get("width")) or 0)
    names: list[str] = []
    for e in events:
        if e.get("event") == "generation" and num(e.get("world_size")) == width:
            names = [str(w) for w in e.get("workers") or ()]
    sums: dict[int, dict[str, list[float]]] = {}
    steps: dict[int, int] = {}
    for e in carrying:
        if num(e.get("width")) != width:
            continue
        for rank, parts in record_ranks(e):
            if rank >= width:
                continue
            steps[rank] = steps.get(rank, 0) + 1
            per = sums.setdefault(rank, {p: [] for p in PARTS})
            for part, value in parts.items():
                if value is not None:
                    per[part].append(value)
    means = [RankMeans(rank=r, worker=names[r] if r < len(names) else None, steps=steps[r],
                       **{p: sum(v) / len(v) if v else None for p, v in sums[r].items()})
             for r in sorted(sums)]
    if not means:
        return RankSummary(width=width)
    slowest = max(means, key=lambda m: m.own_s)
    others = [m for m in means if m is not slowest]

    def excess(part: str) -> float:  # how much more of it than the others' mean
        mine = getattr(slowest, part) or 0.0
        theirs = [getattr(m, part) or 0.0 for m in others]
        return mine - (sum(theirs) / len(theirs) if theirs else 0.0)

    return RankSummary(width=width, ranks=means, slowest=slowest.rank,
                       slowest_worker=slowest.worker,
                       slowest_part=max(("load", "compute"), key=excess))


def rank_scalars(record: Mapping[str, Any], *, limit: int = TRACKED_RANKS) -> dict[str, float]:
    """What trackers log of a record's ranks: ``time/rank<r>/<part>`` for each rank the record
    carries when the job is at most ``limit`` wide; wider, ``time/<part>/max``,
    ``time/<part>/min`` and ``time/<part>/max_rank`` over them."""
    ranks = list(record_ranks(record))
    width = num(record.get("width")) or len(ranks)
    out: dict[str, float] = {}
    if width <= limit:
        for rank, parts in ranks:
            for part, value in parts.items():
                if value is not None:
                    out[f"time/rank{rank}/{part}"] = value
        return out
    for part in PARTS:
        known = [(value, rank) for rank, parts in ranks if (value := parts[part]) is not None]
        if known:
            top, bottom = max(known), min(known)
            out[f"time/{part}/max"], out[f"time/{part}/max_rank"] = top[0], float(top[1])
            out[f"time/{part}/min"] = bottom[0]
    return out
