"""One run's verdict: every planned fault recovered or not, and the run-level checks.

A fault counts as *recovered* when it fired and every worker fault it made
shows in the run's report (:func:`planaria.metrics.summarize`) as a fault
naming that worker, detected and recovered with ``lost_steps`` known, and the
run finished. Per kind, beyond that: a ``slow`` straggler recovers when it was
never evicted (a straggler is healthy: its eviction also counts as a healthy
worker evicted); ``storage_write`` when a ``checkpoint_failed`` followed, or a
writer's retry saved that checkpoint anyway; ``job_kill`` when a later segment
resumed from a checkpoint. A fault whose recovery a later whole-job kill of the
campaign cut short (no step committed between them) is recovered when the
resumed job is. The run-level
checks are :mod:`planaria.campaign.oracle`'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from planaria.campaign import oracle, storage_faults
from planaria.campaign.inject import read_injections
from planaria.campaign.job import FINAL_FILE, META_FILE, snapshot_file
from planaria.campaign.mix import PlannedFault, PlannedRun
from planaria.data_plan import DataPlan, Ledger
from planaria.events import read_events
from planaria.metrics import FaultMetrics, summarize

__all__ = ["FaultVerdict", "RunVerdict", "check_run"]

_WORKER_ACTIONS = {"kill", "hang", "preempt", "kill_join", "kill_save", "kill_restore"}
# How a fault must be reported; a kill or hang of the last replica holding the state is
# rightly "all_replicas_lost" (a compound fault: an earlier one of the run took the others).
_EXPECTED = {"kill": ("worker_lost", "all_replicas_lost"),
             "hang": ("worker_hung", "all_replicas_lost"), "preempt": ("preempted",)}


@dataclass
class FaultVerdict:
    run: int
    fault: int
    kind: str
    step_s: float
    injected: bool = False
    recovered: bool = False
    detect_s: float | None = None
    recover_s: list[float] = field(default_factory=list)
    lost_steps: int | None = None
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    """What the report got wrong without the fault going unrecovered (a wrong kind)."""
    in_run: bool | None = None
    """It fired while an autonomous run of steps was in flight (not a step dispatched alone)."""


@dataclass
class RunVerdict:
    index: int
    run_dir: Path
    step_s: float
    completed: bool
    faults: list[FaultVerdict] = field(default_factory=list)
    diverged: bool = False
    duplicated: int = 0
    missing: int = 0
    healthy_evicted: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    goodput_s: float = 0.0
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.reasons

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["run_dir"] = str(self.run_dir)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunVerdict:
        faults = [FaultVerdict(**f) for f in data.pop("faults")]
        return cls(**{**data, "run_dir": Path(data["run_dir"]), "faults": faults})


def check_run(
    run_dir: Path,
    run: PlannedRun,
    references: dict[int, dict[str, torch.Tensor]],
    *,
    error: str | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> RunVerdict:
    """Checks a finished (or failed) run; ``error`` says why its job did not finish."""
    run_dir = Path(run_dir)
    final = run_dir / FINAL_FILE
    completed = error is None and final.exists()
    v = RunVerdict(run.index, run_dir, run.step_s, completed)
    events = read_events(run_dir).events if (run_dir / "events.jsonl").exists() else []
    injections = read_injections(run_dir)
    fired = {r["id"]: r for r in storage_faults.fired(run_dir / "control")}
    summary = summarize(run_dir) if events else None
    reported = summary.faults if summary is not None else []
    if summary is not None:
        v.goodput_s, v.wall_s = summary.goodput_s, summary.wall_s
    segs = oracle.segments(events)
    faulted = _faulted(injections, fired)
    cuts = {int(i["incarnation"]): float(fired[i["id"]]["t"]) for i in injections
            if i["action"] == "job_kill" and i["id"] in fired}
    for fault in run.faults:
        mine = [i for i in injections if i["fault"] == fault.index]
        v.faults.append(_fault(fault, run, mine, fired, reported, segs, faulted, completed,
                               cuts))
    if not completed:
        v.reasons.append(f"{run_dir}: the job did not finish: {error or 'no final weights'}")
    else:
        _run_checks(v, run, events, faulted, references, atol=atol, rtol=rtol)
    v.reasons += [f"{run_dir}: fault {f.fault} ({f.kind}, step {run.faults[f.fault].step}, "
                  f"step_s={run.step_s:g}): {f.reason}" for f in v.faults if not f.recovered]
    v.reasons += [f"{run_dir}: fault {f.fault} ({f.kind}, step {run.faults[f.fault].step}, "
                  f"step_s={run.step_s:g}): {note}" for f in v.faults for note in f.notes]
    return v


def _faulted(injections: list[dict[str, Any]], fired: dict[str, Any]) -> dict[int, set[str]]:
    """Per job incarnation, the workers the campaign made fail (not stragglers, not NaNs)."""
    out: dict[int, set[str]] = {}
    for inj in injections:
        if inj["id"] in fired and inj["action"] in _WORKER_ACTIONS and inj["worker"]:
            out.setdefault(int(inj["incarnation"]), set()).add(inj["worker"])
    return out


def _run_checks(
    v: RunVerdict, run: PlannedRun, events: list[dict[str, Any]], faulted: dict[int, set[str]],
    references: dict[int, dict[str, torch.Tensor]], *, atol: float, rtol: float,
) -> None:
    from safetensors.torch import load_file

    run_dir = v.run_dir
    if run.steps in references:
        why = oracle.weights_differ(references[run.steps], load_file(str(run_dir / FINAL_FILE)),
                                    atol=atol, rtol=rtol)
        if why is not None:
            v.diverged = True
            v.reasons.append(f"{run_dir}: final weights differ from the reference: {why}"
                             f"{_first_divergence(run_dir, run, references, atol, rtol)}")
    meta = json.loads((run_dir / META_FILE).read_text())
    plan = DataPlan(meta["num_samples"], meta["global_batch_size"], meta["seed"])
    once = oracle.exactly_once(Ledger.committed(run_dir), plan, run.steps,
                               skipped=Ledger.skipped(run_dir))
    v.duplicated, v.missing = once.duplicated, once.missing
    if not once.ok:
        v.reasons.append(f"{run_dir}: ledger: {once.duplicated} duplicated, {once.missing} "
                         f"missing ({'; '.join(once.problems[:3])})")
    for seg, name in oracle.healthy_evicted(events, faulted):
        v.healthy_evicted.append(f"{seg}:{name}")
        v.reasons.append(f"{run_dir}: healthy worker {name} left the membership "
                         f"(segment {seg}): {_why_left(events, seg, name)}")
    v.reasons += [f"{run_dir}: {why}" for why in oracle.restarts_from_zero(events)]


def _first_divergence(
    run_dir: Path, run: PlannedRun, references: dict[int, dict[str, torch.Tensor]],
    atol: float, rtol: float,
) -> str:
    """Where the weights first differ, from the snapshots taken before each fault."""
    from safetensors.torch import load_file

    good = -1
    for steps in sorted(references):
        path = snapshot_file(run_dir, steps)
        if not path.exists():
            continue
        if oracle.weights_differ(references[steps], load_file(str(path)), atol=atol, rtol=rtol):
            return f"; first different after {steps} steps, {_suspects(run, good, steps)}"
        good = steps
    return f"; {_suspects(run, good, run.steps)}"


def _suspects(run: PlannedRun, good: int, bad: int) -> str:
    faults = [f"{f.index}:{f.kind}@{f.step}" for f in run.faults if good <= f.step < bad]
    return f"equal after {good}: fault {', '.join(faults)}" if faults else "before any fault"


def _why_left(events: list[dict[str, Any]], seg: int, name: str) -> str:
    for rec in oracle.segments(events)[seg]:
        if rec.get("event") == "fault" and name in str(rec.get("worker") or "").split(","):
            return f"fault {rec.get('kind')} at step {rec.get('step')}: {rec.get('message')}"
        if rec.get("event") in ("drained", "hang_stack") and rec.get("worker") == name:
            return f"{rec['event']} at t={rec['t']:.3f}"
    return "dropped from a generation"


def _fault(
    fault: PlannedFault, run: PlannedRun, mine: list[dict[str, Any]], fired: dict[str, Any],
    reported: list[FaultMetrics], segs: list[list[dict[str, Any]]], faulted: dict[int, set[str]],
    completed: bool, cuts: dict[int, float],
) -> FaultVerdict:
    fv = FaultVerdict(run.index, fault.index, fault.kind, run.step_s)
    hits = _fired(mine, fired)
    fv.injected = bool(hits)
    if not hits:
        armed = ", ".join(sorted({i["action"] for i in mine})) or "nothing"
        fv.reason = f"never fired (armed: {armed})"
        return fv
    fv.in_run = _in_run(float(fired[hits[0]["id"]]["t"]), int(hits[0]["incarnation"]), segs)
    problems: list[str] = []
    for inj in hits:
        if inj["action"] in _WORKER_ACTIONS or inj["action"] == "nan":
            problems += _reported(fv, inj, fired[inj["id"]], reported, segs, cuts)
    kind = fault.kind
    if kind in ("kill_rerun", "kill_join", "kill_restore", "kill_save") and not any(
        i["role"] == "secondary" for i in hits
    ):
        problems.append("its second fault never fired (phase not reached)")
    if kind == "slow":  # evicted, unless a later fault of the campaign hit it
        seg, name = int(hits[0]["incarnation"]), hits[0]["worker"]
        left = seg < len(segs) and name in oracle.leavers(segs[seg])
        if left and name not in faulted.get(seg, set()):
            problems.append(f"the straggler {name} was evicted")
    if kind == "storage_write":
        # Handled: the save it hit was reported failed, or a writer's retry committed it anyway
        # (the next checkpoint_saved after the error holds the step the error was injected in).
        t = fired[hits[0]["id"]]["t"]
        after = [r for s in segs for r in s if r["t"] >= t]
        failed = any(r.get("event") == "checkpoint_failed" for r in after)
        path = str(fired[hits[0]["id"]].get("path", ""))
        saved = any(r.get("event") == "checkpoint_saved"  # its path is a URL (faulty://...)
                    and str(r.get("path", "")).split("://", 1)[-1] in path for r in after)
        if not failed and not saved:
            problems.append("the write error left no checkpoint_failed record and no retried save")
    if kind == "job_kill":
        problems += _resumed(fv, int(hits[0]["incarnation"]), fired[hits[0]["id"]]["t"], segs)
    if not completed:
        problems.append("the run did not finish")
    fv.recovered = not problems
    fv.reason = "; ".join(problems)
    return fv


def _fired(mine: list[dict[str, Any]], fired: dict[str, Any]) -> list[dict[str, Any]]:
    """The armings of a fault that fired. A fault armed again on another worker (its first
    target left the job before the trigger's step) has several armings under one id and
    fires once: on the process whose pid the firing names; the others never fired."""
    hits = [i for i in mine if i["id"] in fired]
    out = []
    for i in hits:
        pid = fired[i["id"]].get("pid")
        rearmed = sum(j["id"] == i["id"] for j in hits) > 1
        if not rearmed or pid is None or i.get("pid") == pid:
            out.append(i)
    return out


def _in_run(t: float, seg: int, segs: list[list[dict[str, Any]]]) -> bool:
    """Whether time ``t`` falls inside one of the segment's autonomous runs."""
    return seg < len(segs) and any(
        r.get("event") == "run_ahead" and float(r.get("started_t", r["t"])) <= t <= r["t"]
        for r in segs[seg])


def _reported(
    fv: FaultVerdict, inj: dict[str, Any], fired: dict[str, Any], reported: list[FaultMetrics],
    segs: list[list[dict[str, Any]]], cuts: dict[int, float],
) -> list[str]:
    seg = int(inj["incarnation"])
    nan = inj["action"] == "nan"
    cands = [f for f in reported if f.segment == seg and f.detected_t >= fired["t"] - 1.0
             and (f.kind == "nonfinite_loss" if nan else inj["worker"] in f.workers)]
    what = "the non-finite loss" if nan else f"{inj['action']} of {inj['worker']}"
    if not cands:
        return [f"{what} is not in the report"]
    f = cands[0]
    if fv.detect_s is None:
        fv.detect_s = f.detect_s
    problems: list[str] = []
    expected = _EXPECTED.get(inj["action"])
    if expected is not None and f.kind not in expected:
        fv.notes.append(f"{what} reported as {f.kind}, not {' or '.join(expected)}")
    if not f.recovered or f.recover_s is None:
        # Its recovery was cut short by the campaign's own whole-job kill (the next fault,
        # armed once the job was back at full width, fired before the step that would have
        # closed this one): recovered when the resumed job was.
        cut = cuts.get(seg)
        if cut is not None and cut >= f.detected_t:
            resumed = FaultVerdict(fv.run, fv.fault, fv.kind, fv.step_s)
            if not _resumed(resumed, seg, float(fired["t"]), segs) and resumed.recover_s:
                fv.recover_s += resumed.recover_s
                fv.lost_steps = (fv.lost_steps or 0) + (resumed.lost_steps or 0)
                return problems
        return [*problems, f"{what} (fault {f.fault_id}) never recovered"]
    if f.detect_s is None or f.lost_steps is None:
        problems.append(f"{what} (fault {f.fault_id}) has no detect_s or lost_steps")
    fv.recover_s.append(f.recover_s)
    fv.lost_steps = (fv.lost_steps or 0) + (f.lost_steps or 0)
    return problems


def _resumed(fv: FaultVerdict, seg: int, t: float, segs: list[list[dict[str, Any]]]) -> list[str]:
    if seg + 1 >= len(segs):
        return ["no job resumed after the whole-job kill"]
    after = segs[seg + 1]
    restores = [r for r in after if r.get("event") == "restore"]
    if not restores or not restores[0].get("step"):
        return ["the resumed job did not restore a checkpoint"]
    commits = [r for r in after if r.get("event") == "step_committed"]
    if commits:
        fv.recover_s.append(float(commits[0]["t"]) - t)
        fv.lost_steps = restores[0].get("lost_steps")
    return []
