"""The campaign's checks, independent of the runtime's own bookkeeping.

Each check reads what a run left (final weights, the ledger the workers' reports
filled, events.jsonl, the injector's records) and returns counts and reasons,
never asserting, so that a campaign can add them up:

- :func:`exactly_once`: samples duplicated or missing against the data plan;
- :func:`weights_differ`: the final weights against the reference (assert_close);
- :func:`leavers` / :func:`healthy_evicted`: workers that left the membership
  that the campaign did not fault;
- :func:`restarts_from_zero`: a restore to step 0, or a segment that began over.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from planaria.data_plan import DataPlan

__all__ = [
    "ExactlyOnce",
    "exactly_once",
    "healthy_evicted",
    "leavers",
    "restarts_from_zero",
    "segments",
    "weights_differ",
]


@dataclass
class ExactlyOnce:
    """What the ledger shows against the plan: samples trained twice, samples never trained."""

    duplicated: int = 0
    missing: int = 0
    skipped: int = 0
    """Samples of steps skipped on purpose (non-finite, the policy's skip): consumed, not
    trained, and neither missing nor duplicated."""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.duplicated and not self.missing


def exactly_once(ledger: Mapping[int, list[int]], plan: DataPlan, steps: int,
                 skipped: Mapping[int, list[int]] | None = None) -> ExactlyOnce:
    """Counts, over steps ``0..steps-1`` of the committed lineage, the samples each step
    trained beyond its planned batch (duplicated) and the planned ones it lacks (missing).
    Every sample appears once per epoch in the plan, so this is exactly-once per epoch.
    ``skipped`` (:meth:`Ledger.skipped <planaria.ledger.Ledger.skipped>`) holds the steps
    skipped on purpose, with what they were served: their samples count as skipped."""
    out = ExactlyOnce()
    skipped = skipped or {}
    for step in range(steps):
        planned = Counter(int(i) for i in plan.batch(step))
        if step in skipped and step not in ledger:
            got = Counter(int(i) for i in skipped[step])
            out.skipped += sum((got & planned).values())
            extra, lacking = got - planned, planned - got
            if extra or lacking:
                out.problems.append(f"skipped step {step}: {sum(extra.values())} samples "
                                    f"beyond its batch, {sum(lacking.values())} missing")
            out.duplicated += sum(extra.values())
            out.missing += sum(lacking.values())
            continue
        got = Counter(int(i) for i in ledger.get(step, []))
        extra, lacking = got - planned, planned - got
        if step not in ledger:
            out.problems.append(f"step {step} is not in the ledger")
        elif extra or lacking:
            out.problems.append(
                f"step {step}: {sum(extra.values())} samples beyond its batch, "
                f"{sum(lacking.values())} of its batch missing"
            )
        out.duplicated += sum(extra.values())
        out.missing += sum(lacking.values())
    beyond = sorted(s for s in ledger if s >= steps or s < 0)
    if beyond:
        out.duplicated += sum(len(ledger[s]) for s in beyond)
        out.problems.append(f"steps {beyond} beyond the run's {steps} are in the ledger")
    return out


def weights_differ(
    reference: Mapping[str, torch.Tensor],
    got: Mapping[str, torch.Tensor],
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> str | None:
    """None if every tensor is close to the reference's, else what differs (first one)."""
    if set(reference) != set(got):
        return f"tensor names differ: {sorted(set(reference) ^ set(got))[:5]}"
    for name in sorted(reference):
        try:
            torch.testing.assert_close(got[name], reference[name], atol=atol, rtol=rtol)
        except AssertionError as err:
            return f"{name}: {str(err).splitlines()[0]} ({' '.join(str(err).split())[:160]})"
    return None


def segments(events: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The log cut at each ``run_start``: one list per process that ran the job."""
    out: list[list[dict[str, Any]]] = []
    for rec in events:
        if rec.get("event") == "run_start" or not out:
            out.append([])
        out[-1].append(rec)
    return out


def leavers(segment: list[dict[str, Any]]) -> set[str]:
    """Workers that left the membership in one segment: dropped between two generations,
    or named by a ``fault``, ``drained`` or ``hang_stack`` record."""
    gone: set[str] = set()
    previous: set[str] | None = None
    for rec in segment:
        ev = rec.get("event")
        if ev == "generation":
            current = set(rec.get("workers") or [])
            if previous is not None:
                gone |= previous - current
            previous = current
        elif ev == "fault":
            gone |= {w.strip() for w in str(rec.get("worker") or "").split(",") if w.strip()}
        elif ev in ("drained", "hang_stack") and rec.get("worker"):
            gone.add(str(rec["worker"]))
    return gone


def healthy_evicted(
    events: list[dict[str, Any]], faulted: Mapping[int, set[str]]
) -> list[tuple[int, str]]:
    """(segment, worker) for every worker that left without being faulted in that segment."""
    out = []
    for index, segment in enumerate(segments(events)):
        for name in sorted(leavers(segment) - faulted.get(index, set())):
            out.append((index, name))
    return out


def restarts_from_zero(events: list[dict[str, Any]]) -> list[str]:
    """Why the run began over from step 0 after having made progress (empty: it did not)."""
    out = []
    high = -1
    for index, segment in enumerate(segments(events)):
        first_commit = True
        for rec in segment:
            ev = rec.get("event")
            if ev == "restore" and rec.get("step") == 0:
                out.append(f"segment {index}: restore to step 0 ({rec.get('reason', 'restore')})")
            elif ev == "step_committed":
                step = int(rec.get("step", 0))
                if step == 0 and high >= 0 and first_commit:
                    out.append(f"segment {index} began over at step 0 after step {high}")
                elif step == 0 and high >= 0:
                    out.append(f"segment {index}: step 0 committed again after step {high}")
                high = max(high, step)
                first_commit = False
    return out
