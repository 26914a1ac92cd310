"""The campaign's checks, independent of the runtime's own bookkeeping.

Each check reads what a run left (final weights, the ledger the workers' reports
filled, events.jsonl, the injector's records) and returns counts and reasons,
never asserting, so that a campaign can add them up:

- :func:`exactly_once`: samples duplicated or missing in the ledger against the data plan;
- :func:`loaded_once`: the same from the campaign dataset's own load record (a run on the
  user's defaults has no ledger): every planned sample loaded for its step, none for another;
- :func:`weights_differ`: the final weights against the reference (assert_close);
- :func:`leavers` / :func:`healthy_evicted`: workers that left the membership
  that the campaign did not fault;
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from planaria.data.plan import DataPlan

__all__ = [
    "ExactlyOnce",
    "exactly_once",
    "healthy_evicted",
    "leavers",
    "loaded_once",
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


def _planned(plan: DataPlan, step: int, skip: Mapping[int, int]) -> list[int]:
    """Step ``step``'s batch less the samples skipped from a step at or before it."""
    return [int(i) for i in plan.batch(step) if int(i) not in skip or step < skip[int(i)]]


def exactly_once(
    ledger: Mapping[int, list[int]], plan: DataPlan, steps: int,
    skipped: Mapping[int, list[int]] | None = None,
    *, skip: Mapping[int, int] | None = None,
) -> ExactlyOnce:
    """Counts, over steps ``0..steps-1`` of the committed lineage, the samples each step
    trained beyond its planned batch (duplicated) and the planned ones it lacks (missing).
    Every sample appears once per epoch in the plan, so this is exactly-once per epoch.
    ``skipped`` (:meth:`Ledger.skipped <planaria.data.ledger.Ledger.skipped>`) holds the steps
    skipped on purpose, with what they were served: their samples count as skipped.
    ``skip`` maps a sample that could not be read (a work fault skipped) to the first step
    it was skipped at."""
    out = ExactlyOnce()
    skipped = skipped or {}
    skip = skip or {}
    for step in range(steps):
        planned = Counter(_planned(plan, step, skip))
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
        got = Counter(int(i) for i in ledger.get(step, [])
                      if int(i) not in skip or step < skip[int(i)])
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


def loaded_once(
    loads: Iterable[tuple[int, int, int]], plan: DataPlan, steps: int,
    *, skip: Mapping[int, int] | None = None,
) -> ExactlyOnce:
    """From the dataset's own record of ``(pid, step, sample)`` loads: over steps
    ``0..steps-1``, the samples loaded for a step whose batch does not hold them
    (duplicated: served for another step) and the planned ones never loaded for their step
    (missing). A step is loaded again when it runs again (a failure, a rollback), and the
    next step is loaded ahead: at least once is what loads can show; twice-trained is what
    the final weights show."""
    out = ExactlyOnce()
    skip = skip or {}
    got: dict[int, set[int]] = {}
    for _, step, sample in loads:
        got.setdefault(int(step), set()).add(int(sample))
    for step in range(steps):
        batch = {int(i) for i in plan.batch(step)}
        planned = set(_planned(plan, step, skip))
        have = got.get(step, set())
        extra, lacking = have - batch, planned - have
        if extra or lacking:
            out.problems.append(f"step {step}: {len(extra)} samples of other steps loaded, "
                                f"{len(lacking)} of its batch never loaded")
        out.duplicated += len(extra)
        out.missing += len(lacking)
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
    or named by a ``fault``, ``drained`` or ``hang_stack`` record. The members a start over
    replaces (a restore with no checkpoint: fresh workers build the initial state, by the
    policy's design) did not leave for a fault of theirs and are not counted."""
    gone: set[str] = set()
    previous: set[str] | None = None
    # A fault whose action evicts no one (the work runs again elsewhere, or is skipped)
    # names the worker it happened on, not one that left.
    kept = {r.get("fault_id") for r in segment if r.get("event") == "action"
            and r.get("action") in ("retry_elsewhere", "skip")}
    for index, rec in enumerate(segment):
        ev = rec.get("event")
        if ev == "generation":
            current = set(rec.get("workers") or [])
            if previous is not None and not _starts_over(segment, index):
                gone |= previous - current
            previous = current
        elif ev == "fault" and rec.get("fault_id") not in kept:
            gone |= {w.strip() for w in str(rec.get("worker") or "").split(",") if w.strip()}
        elif ev in ("drained", "hang_stack") and rec.get("worker"):
            gone.add(str(rec["worker"]))
    return gone


def _starts_over(segment: list[dict[str, Any]], index: int) -> bool:
    """The generation at ``index`` is a start over's: a ``restore`` of no checkpoint (step 0,
    no path) follows it before the next generation."""
    if segment[index].get("reason") != "restore":
        return False
    for rec in segment[index + 1:]:
        if rec.get("event") == "generation":
            return False
        if rec.get("event") == "restore":
            return rec.get("step") == 0 and rec.get("path") is None
    return False


def healthy_evicted(
    events: list[dict[str, Any]], faulted: Mapping[int, set[str]]
) -> list[tuple[int, str]]:
    """(segment, worker) for every worker that left without being faulted in that segment."""
    out = []
    for index, segment in enumerate(segments(events)):
        for name in sorted(leavers(segment) - faulted.get(index, set())):
            out.append((index, name))
    return out
