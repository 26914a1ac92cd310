"""One run's verdict: every planned fault recovered (or tolerated) or not, inside its
bounds or not, and the run-level checks.

Everything is measured by the campaign (:mod:`planaria.campaign.timeline`): times
from ``control/fired.jsonl`` (the injection's own clock) to the event log's
records, lost steps from the committed steps themselves, never the runtime's own
``detect_s``/``recover_s``/``lost_steps``.

A fault of a *recovery* kind is recovered when it fired, every worker fault it
made shows in the event log as a ``fault`` record naming that worker (a NaN: a
``nonfinite_loss`` one) followed by a committed step, the kind's own condition
holds (see docs/campaign.md's table) and the run finished. A fault of a
*tolerated* kind (:data:`~planaria.campaign.mix.TOLERATED_KINDS`: a straggler, a
write error, a bad or slow sample, a heavy micro-batch, a pause, a full disk)
needs no recovery: it is tolerated when nothing was evicted for it, the kind's
condition holds and the run finished; such faults are counted apart.

The bounds (:data:`BOUNDS`), each a number against a limit:

- ``detect_0.5s``: a member's death (SIGKILL) to its ``fault`` record, <= 0.5 s;
- ``kill_recovered``: a kill to the next committed step, <= its detection + one
  step (at the width after it) + the replacement's start (when the recovering
  step has it) + :data:`RECOVERY_SLACK_S`;
- ``lost_steps``: 0 while a replica holds the state; after a recovery that
  restores a checkpoint (:data:`~planaria.campaign.mix.CHECKPOINT_KINDS`, or an
  ``all_replicas_lost``), <= the steps since the newest save whose writers had
  all finished when the fault fired;
- ``notice_to_snapshot_1s``: a preemption notice to every member to the start of
  the save of the step in hand (``checkpoint_started``), <= 1 s;
- ``stall_evicted``: a stalled worker to its eviction, <= the step deadline + 5 s;
- ``link_evicted``: a worker cut off from its peers (link_stall) to its eviction, <= the
  step deadline + 5 s;
- ``commit_0.2s`` (per save of the run): the last writer's finish
  (``writers_done_t``, else the last shard's close through faulty://) to
  ``checkpoint_saved``, <= 0.2 s.

The run-level checks are :mod:`planaria.campaign.oracle`'s (every member's final
weights against the independent reference, exactly-once from the ledger or the
dataset's load record, no healthy worker evicted) and no process left behind.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from planaria.campaign import oracle
from planaria.campaign.dataset import read_loads
from planaria.campaign.inject import read_injections
from planaria.campaign.job import FINAL_FILE, JOB_DIR, META_FILE, final_file, snapshot_file
from planaria.campaign.mix import (
    CHECKPOINT_KINDS,
    TOLERATED_KINDS,
    WHOLE_JOB_KINDS,
    PlannedFault,
    PlannedRun,
)
from planaria.campaign.timeline import Timeline, partial_saves
from planaria.data_plan import DataPlan, Ledger

__all__ = ["BOUNDS", "Bound", "FaultVerdict", "RunVerdict", "check_run", "skipped_samples"]

BOUNDS = ("detect_0.5s", "kill_recovered", "lost_steps", "notice_to_snapshot_1s",
          "stall_evicted", "link_evicted", "commit_0.2s")
DETECT_S = 0.5
NOTICE_S = 1.0
COMMIT_S = 0.2
STALL_SLACK_S = 5.0
RECOVERY_SLACK_S = 1.0
"""Beyond detection, one step and the replacement's start: the new generation's group and
the scheduling of the re-run step on a loaded machine."""
_NAMES = {"gcs_kill": ("gcs",), "raylet_kill": ("raylet",)}

References = Callable[[PlannedRun, Path], dict[int, dict[str, torch.Tensor]]]


@dataclass
class Bound:
    name: str
    value: float | None
    """What was measured (None: what it bounds never happened, a violation)."""
    limit: float
    what: str = ""

    @property
    def ok(self) -> bool:
        return self.value is not None and self.value <= self.limit + 1e-9

    def describe(self) -> str:
        got = "never" if self.value is None else f"{self.value:.3f}"
        return f"{self.name}: {got} > {self.limit:.3f} ({self.what})"


@dataclass
class FaultVerdict:
    run: int
    fault: int
    kind: str
    step_s: float
    injected: bool = False
    recovered: bool = False
    """A recovery kind: recovered; a tolerated kind: tolerated (nothing lost, no one evicted)."""
    tolerated: bool = False
    """A kind that needs no recovery (counted apart)."""
    detect_s: float | None = None
    recover_s: list[float] = field(default_factory=list)
    lost_steps: int | None = None
    bounds: list[Bound] = field(default_factory=list)
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    """What the report got wrong without the fault going unrecovered (a wrong kind)."""
    in_run: bool | None = None
    """It fired while an autonomous run of steps was in flight (not a step dispatched alone)."""
    skipped: str | None = None
    """Why it was not injected on purpose (a tmpfs that could not be mounted)."""
    figures: dict[str, float] = field(default_factory=dict)
    """Measured, with no bound: ``end_s`` (a fault of Ray's own processes: the kill to the
    end of the job's process), ``restart_s`` (a kill in a start: the kill to the next
    replacement or spare ready)."""
    outcome: str = ""
    """A fault of Ray's own processes: whether the job ended (and was started again) or
    outlived it and finished."""

    @property
    def violations(self) -> list[Bound]:
        return [b for b in self.bounds if not b.ok]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FaultVerdict:
        bounds = [Bound(**b) for b in data.pop("bounds", [])]
        return cls(**data, bounds=bounds)


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
    bounds: list[Bound] = field(default_factory=list)
    """The run's own bounds (``commit_0.2s``, per save)."""
    processes_left: list[str] = field(default_factory=list)
    shape: str = ""

    @property
    def ok(self) -> bool:
        return not self.reasons

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["run_dir"] = str(self.run_dir)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunVerdict:
        data = dict(data)
        faults = [FaultVerdict.from_json(dict(f)) for f in data.pop("faults")]
        bounds = [Bound(**b) for b in data.pop("bounds", [])]
        return cls(**{**data, "run_dir": Path(data["run_dir"]), "faults": faults,
                      "bounds": bounds})


def skipped_samples(run_dir: Path) -> dict[int, int]:
    """The samples a run's ``bad_sample`` faults made unreadable: id -> the first step."""
    return {int(r["sample"]): int(r["from_step"]) for r in read_injections(run_dir)
            if r.get("action") == "bad_sample"}


def check_run(
    run_dir: Path,
    run: PlannedRun,
    references: References,
    *,
    error: str | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> RunVerdict:
    """Checks a finished (or failed) run; ``error`` says why its job did not finish;
    ``references(run, run_dir)`` gives the reference's weights at every step count that
    run has a file for (:func:`snapshot_counts`)."""
    run_dir = Path(run_dir)
    job_dir = run_dir / JOB_DIR
    completed = error is None and (run_dir / FINAL_FILE).exists()
    v = RunVerdict(run.index, run_dir, run.step_s, completed, shape=run.shape.describe())
    tl = Timeline.read(run_dir, job_dir)
    injections = read_injections(run_dir)
    if tl.events:
        from planaria.metrics import summarize

        summary = summarize(job_dir)
        v.goodput_s, v.wall_s = summary.goodput_s, summary.wall_s
    faulted = _faulted(injections, tl)
    for fault in run.faults:
        mine = [i for i in injections if i["fault"] == fault.index]
        others = [(float(tl.fired[i["id"]]["t"]), {str(n) for n in i.get("victims") or []})
                  for i in injections if i["fault"] != fault.index and i["id"] in tl.fired]
        v.faults.append(_fault(fault, run, mine, tl, completed, run_dir, others))
    if not completed:
        v.reasons.append(f"{run_dir}: the job did not finish: {error or 'no final weights'}")
    else:
        _run_checks(v, run, tl, faulted, references, atol=atol, rtol=rtol)
    v.bounds = _commit_bounds(tl)
    for job in tl.jobs:
        v.processes_left += [f"{pid} ({what})"
                             for pid, what in sorted((job.get("left") or {}).items())]
    if v.processes_left:
        v.reasons.append(f"{run_dir}: {len(v.processes_left)} processes of the job left behind "
                         f"({'; '.join(v.processes_left[:3])})")
    v.reasons += [f"{run_dir}: bound {b.describe()}" for b in v.bounds if not b.ok]
    for f in v.faults:
        where = f"{run_dir}: fault {f.fault} ({f.kind}, step {run.faults[f.fault].step}, " \
                f"step_s={run.step_s:g})"
        if f.skipped is None and not f.recovered:
            v.reasons.append(f"{where}: {f.reason}")
        v.reasons += [f"{where}: {note}" for note in f.notes]
        v.reasons += [f"{where}: bound {b.describe()}" for b in f.violations]
    return v


def snapshot_counts(run: PlannedRun, run_dir: Path) -> list[int]:
    """The step counts a run's weights exist for: its end and its pre-fault snapshots."""
    counts = {run.steps}
    for path in Path(run_dir).glob("at-*.safetensors"):
        counts.add(int(path.stem.removeprefix("at-")))
    return sorted(counts)


# ---- the faulted workers -------------------------------------------------------------------


def _faulted(injections: list[dict[str, Any]], tl: Timeline) -> dict[int, set[str]]:
    """Per job incarnation, the workers the campaign made fail (not stragglers, not NaNs)."""
    out: dict[int, set[str]] = {}
    for inj in injections:
        hit = tl.fired.get(inj["id"])
        if hit is None:
            continue
        seg = int(inj["incarnation"])
        names = set(inj.get("victims") or [])
        if inj["kind"] in _NAMES:  # Ray's own process: every worker of the job goes with it
            names |= set(inj.get("workers") or {})
            names |= {str(r["worker"]) for e in ("replacement_requested", "spare_requested")
                      for r in tl.in_segment(seg, e) if float(r["t"]) >= float(hit["t"])}
        if inj.get("expect_victim") == "reader" or inj.get("action") == "kill_starting":
            name = hit.get("worker") or tl.worker_of(seg, hit.get("pid"))
            if name:
                names.add(str(name))
        out.setdefault(seg, set()).update(n.split(".", 1)[0] for n in names)
    return out


def _fired(mine: list[dict[str, Any]], tl: Timeline) -> list[dict[str, Any]]:
    """The armings of a fault that fired. A fault armed again on another worker (its first
    target left the job before the trigger's step) has several armings under one id and
    fires once: on the process whose pid the firing names; the others never fired."""
    hits = [i for i in mine if i["id"] in tl.fired]
    out = []
    for i in hits:
        pid = tl.fired[i["id"]].get("pid")
        rearmed = sum(j["id"] == i["id"] for j in hits) > 1
        if not rearmed or pid is None or i.get("pid") == pid:
            out.append(i)
    return out


# ---- one fault -----------------------------------------------------------------------------


def _fault(
    fault: PlannedFault, run: PlannedRun, mine: list[dict[str, Any]], tl: Timeline,
    completed: bool, run_dir: Path, others: list[tuple[float, set[str]]],
) -> FaultVerdict:
    fv = FaultVerdict(run.index, fault.index, fault.kind, run.step_s,
                      tolerated=fault.kind in TOLERATED_KINDS)
    skipped = [i for i in mine if i["action"] == "skipped"]
    if skipped:
        fv.skipped = str(skipped[0].get("why", "skipped"))
        fv.reason = f"skipped: {fv.skipped}"
        return fv
    hits = _fired(mine, tl)
    fv.injected = bool(hits)
    if not hits:
        armed = ", ".join(sorted({i["action"] for i in mine})) or "nothing"
        fv.reason = f"never fired (armed: {armed})"
        return fv
    first = min(hits, key=lambda i: tl.fired[i["id"]]["t"])
    t0 = float(tl.fired[first["id"]]["t"])
    seg = int(first["incarnation"])
    fv.in_run = _in_run(t0, seg, tl)
    problems: list[str] = []
    for inj in hits:
        if inj.get("expect") and not _two_rank_cut(inj, tl, run):
            problems += _reported(fv, fault, inj, tl, run)
    problems += _KIND_CHECKS.get(fault.kind, _no_check)(fv, fault, run, hits, tl, run_dir)
    if fault.kind in WHOLE_JOB_KINDS:
        whole = next((i for i in hits if i["role"] == "primary"), first)
        if not (fault.kind in _NAMES and _outlived(tl, int(whole["incarnation"]))):
            problems += _resumed(fv, fault, int(whole["incarnation"]),
                                 float(tl.fired[whole["id"]]["t"]), tl, run)
    if fault.kind in TOLERATED_KINDS:
        problems += _nothing_lost(fv, seg, t0, tl, first.get("worker"), others)
    if not completed:
        problems.append("the run did not finish")
    fv.recovered = not problems
    fv.reason = "; ".join(problems)
    return fv


def _in_run(t: float, seg: int, tl: Timeline) -> bool:
    """Whether time ``t`` falls inside one of the segment's autonomous runs."""
    return any(float(r.get("started_t", r["t"])) <= t <= r["t"]
               for r in tl.in_segment(seg, "run_ahead"))


def _victim(inj: dict[str, Any], tl: Timeline) -> str | None:
    if inj.get("expect_victim") == "reader":  # the replica whose worker read (a follower's)
        hit = tl.fired[inj["id"]]
        name = hit.get("worker") or tl.worker_of(int(inj["incarnation"]), hit.get("pid"))
        return None if name is None else str(name).split(".", 1)[0]
    victims = inj.get("victims") or []
    return str(victims[0]) if victims else inj.get("worker")


def _reported(fv: FaultVerdict, fault: PlannedFault, inj: dict[str, Any], tl: Timeline,
              run: PlannedRun) -> list[str]:
    """The worker fault ``inj`` made, in the report: detected, recovered, within bounds."""
    seg = int(inj["incarnation"])
    t0 = float(tl.fired[inj["id"]]["t"])
    nan = inj["action"] == "nan"
    name = None if nan else _victim(inj, tl)
    cands = [r for r in tl.in_segment(seg, "fault") if float(r["t"]) >= t0 - 1.0
             and (r.get("kind") == "nonfinite_loss" if nan else
                  name in str(r.get("worker") or "").split(","))]
    what = "the non-finite loss" if nan else f"{inj['action']} of {name}"
    if not cands and nan and _absorbed(t0, seg, tl):
        fv.outcome = ABSORBED
        return []
    if not cands:
        return [f"{what} is not in the report"]
    expected = inj.get("expect") or []
    # Its record: the first of an expected kind (a record of an earlier fault of the same
    # worker may fall inside the lookback), else the first.
    rec = next((r for r in cands if r.get("kind") in expected), cands[0])
    detect = float(rec["t"]) - t0
    if fv.detect_s is None:
        fv.detect_s = round(detect, 4)
    if rec.get("kind") not in expected:
        fv.notes.append(f"{what} reported as {rec.get('kind')}, not {' or '.join(expected)}")
    killed = inj["action"] in ("kill", "kill_write", "kill_read", "kill_join", "kill_save",
                               "kill_final_snapshot")
    if killed and rec.get("kind") != "all_replicas_lost":
        # Detected: the controller's first record of the death (failure_seen, at Ray's notice),
        # else its fault record.
        seen = [float(r["t"]) for r in tl.in_segment(seg, "failure_seen")
                if r.get("worker") == name and float(r["t"]) >= t0 - 0.05]
        first = min([*seen, float(rec["t"])])
        fv.bounds.append(Bound("detect_0.5s", round(first - t0, 4), DETECT_S,
                               f"{what}: fired to the controller's first record of it"))
    if fault.kind == "kill_final_save":  # no step follows: the final save is its recovery
        # The save may have committed before the death was recorded (its shards were
        # written when the kill landed): then it needed no recovery.
        saved = [r for r in tl.after(t0 - 1.0, "checkpoint_saved")
                 if int(r["step"]) >= run.steps]
        if not saved:
            return [f"{what} (fault {rec.get('fault_id')}): the final save never committed"]
        fv.recover_s.append(round(max(0.0, float(saved[-1]["t"]) - t0), 4))
        return []
    commit = tl.first_commit_after(float(rec["t"]), seg)
    if commit is None:
        return [f"{what} (fault {rec.get('fault_id')}) never recovered"]
    recover = commit.t - t0
    fv.recover_s.append(round(recover, 4))
    done = tl.done_before(t0, seg)
    lost = max(0, done - commit.step)
    fv.lost_steps = (fv.lost_steps or 0) + lost
    # Faults recorded after this one and before the step that closed it: that recovery
    # was theirs too (a second kill took the last replica).
    later = [r for r in tl.in_segment(seg, "fault")
             if float(rec["t"]) < float(r["t"]) <= commit.t]
    # A rollback restores a checkpoint, and so does a loss of every replica; a kill in the
    # job started again (kill_resumed's second half) is a plain kill.
    restores = (nan or any(r.get("kind") == "all_replicas_lost" for r in [rec, *later])
                or (fault.kind in CHECKPOINT_KINDS and fault.kind != "kill_resumed")
                or _every_holder_lost(tl, seg, float(rec["t"]), commit.t))
    limit = done - tl.newest_durable(t0, done) if restores else 0
    fv.bounds.append(Bound("lost_steps", lost, max(0, limit),
                           f"{what}: steps committed before it and again after"))
    if killed and rec.get("kind") == "worker_lost" and commit.segment == seg and not later:
        fv.bounds.append(Bound("kill_recovered", round(recover, 4),
                               _recovery_limit(detect, name, t0, commit, tl, run),
                               f"{what}: fired to the next committed step"))
    return []


def _recovery_limit(detect: float, victim: str | None, t0: float, commit: Any, tl: Timeline,
                    run: PlannedRun) -> float:
    """Detection + one step at the width after the fault + the replacement's start (when
    the recovering step has it) + slack."""
    seg = commit.segment
    full = tl.step_length(t0, seg) or run.step_s
    # The width the step length was measured at; in a job started again that has committed
    # nothing yet, the width of the generation the fault hit.
    before = max((c.width for c in tl.commits if c.segment == seg and c.t <= t0),
                 default=0) or tl.width_at(t0, seg) or 0
    total = _micro_batches(tl, seg)
    share = (lambda w: -(-total // max(1, w))) if total else (lambda w: 1)
    one_step = full * share(commit.width) / share(before or commit.width)
    start = 0.0
    if victim is not None and commit.width >= before:
        asked = {r["worker"]: float(r["t"]) for r in tl.in_segment(seg, "replacement_requested")
                 if r.get("replaces") == victim}
        for r in tl.in_segment(seg, "replacement_ready"):
            if r.get("worker") in asked and float(r["t"]) <= commit.t:
                start = max(start, float(r["t"]) - asked[r["worker"]])
    return round(detect + one_step + start + RECOVERY_SLACK_S, 4)


def _micro_batches(tl: Timeline, seg: int) -> int:
    for r in tl.in_segment(seg, "run_start"):
        gbs, mbs = r.get("global_batch_size"), r.get("micro_batch_size")
        if gbs and mbs:
            return int(gbs) // int(mbs)
    return 0


def _nothing_lost(fv: FaultVerdict, seg: int, t0: float, tl: Timeline, target: str | None,
                  others: list[tuple[float, set[str]]]) -> list[str]:
    """A fault that needs no recovery (a straggler, a pause, a heavy micro-batch, a bad or
    slow sample, a full disk, a write error): no worker left the job for it, from its firing to
    the next fault the campaign fired (``others``: their times and victims), the victims
    of those left out (a straggler armed on a worker a preemption was draining)."""
    end = min((t for t, _ in others if t > t0), default=float("inf"))
    theirs = set().union(*(v for _, v in others)) if others else set()
    # Faults that evict no one (the work ran again elsewhere, a bad sample was skipped): the
    # runtime telling the work's fault from the worker's, not a loss.
    kept = {r.get("fault_id") for r in tl.in_segment(seg, "action")
            if r.get("action") in ("retry_elsewhere", "skip")}
    for r in tl.in_segment(seg, "fault"):
        if not t0 <= float(r["t"]) < end or r.get("kind") == "nonfinite_loss":
            continue  # before it, or a NaN another fault of the run returned
        if r.get("fault_id") in kept:
            continue
        named = {w.strip() for w in str(r.get("worker") or "").split(",") if w.strip()}
        if named & theirs or (target is not None and named and target not in named):
            continue
        return [f"needed no recovery, yet {r.get('worker') or 'the job'} was reported as "
                f"{r.get('kind')} at step {r.get('step')}: {r.get('message')}"]
    return []


def _no_check(*_: Any) -> list[str]:
    return []


# ---- per kind ------------------------------------------------------------------------------


ABSORBED = "its step failed for another fault first: nothing non-finite was reduced"


def _absorbed(t0: float, seg: int, tl: Timeline) -> bool:
    """A non-finite gradient injected in a step that then failed for another fault (a peer
    died before the reduction): the attempt was dropped, the step ran again without it."""
    step = tl.done_before(t0, seg)
    return any(int(r.get("step", -1)) == step and r.get("kind") != "nonfinite_loss"
               for r in tl.in_segment(seg, "step_failed") if float(r["t"]) >= t0)


def _second_half(fv: FaultVerdict, fault: PlannedFault, run: PlannedRun,
                 hits: list[dict[str, Any]], tl: Timeline, run_dir: Path) -> list[str]:
    if fv.outcome == ABSORBED:
        return []  # its first half did nothing: the phase its second waits for never came
    if not any(i["role"] == "secondary" for i in hits):
        return ["its second fault never fired (phase not reached)"]
    return []


def _storage_write(fv: FaultVerdict, fault: PlannedFault, run: PlannedRun,
                   hits: list[dict[str, Any]], tl: Timeline, run_dir: Path) -> list[str]:
    # Handled: the save it hit was reported failed, or a writer's retry committed it anyway
    # (the next checkpoint_saved after the error holds the step the error was injected in).
    hit = tl.fired[hits[0]["id"]]
    after = [r for r in tl.events if r["t"] >= hit["t"]]
    failed = any(r.get("event") == "checkpoint_failed" for r in after)
    path = str(hit.get("path", ""))
    saved = any(r.get("event") == "checkpoint_saved"  # its path is a URL (faulty://...)
                and str(r.get("path", "")).split("://", 1)[-1] in path for r in after)
    if not failed and not saved:
        return ["the write error left no checkpoint_failed record and no retried save"]
    return []


def _bad_sample(fv: FaultVerdict, fault: PlannedFault, run: PlannedRun,
                hits: list[dict[str, Any]], tl: Timeline, run_dir: Path) -> list[str]:
    sample = int(hits[0]["sample"])
    t0 = float(tl.fired[hits[0]["id"]]["t"])
    for r in tl.after(t0 - 1.0, "sample_skipped"):
        named = ([r.get(k) for k in ("sample", "sample_id", "id")] + list(r.get("ids") or [])
                 + list(r.get("samples") or []))
        if sample in [int(x) for x in named if x is not None]:
            return []
    return [f"no sample_skipped record names sample {sample} (it raised OSError in every "
            "load from its step on)"]


def _stall(fv: FaultVerdict, fault: PlannedFault, run: PlannedRun, hits: list[dict[str, Any]],
           tl: Timeline, run_dir: Path) -> list[str]:
    inj = hits[0]
    seg, name = int(inj["incarnation"]), inj.get("worker")
    t0 = float(tl.fired[inj["id"]]["t"])
    evicted = [float(r["t"]) for r in tl.in_segment(seg, "hang_stack")
               if r.get("worker") == name and float(r["t"]) >= t0]
    evicted += [float(r["t"]) for r in tl.in_segment(seg, "fault") if float(r["t"]) >= t0
                and name in str(r.get("worker") or "").split(",")]
    limit = tl.deadline(t0, seg) + STALL_SLACK_S
    fv.bounds.append(Bound("stall_evicted", round(min(evicted) - t0, 4) if evicted else None,
                           round(limit, 4), f"the stalled {name} evicted as hung"))
    return []


def _two_rank_cut(inj: dict[str, Any], tl: Timeline, run: PlannedRun) -> bool:
    """A link cut while the job ran at two ranks (an earlier fault of the run took the
    third): both ends of the one dead flow look alike, so no culprit can be named and the
    runtime builds the generation again on fresh connections, evicting no one."""
    if inj.get("action") != "cut_links" or run.shape.workers_per_replica != 1:
        return False
    t0 = float(tl.fired[inj["id"]]["t"])
    return len(tl.members_at(t0, int(inj["incarnation"]))) == 2


def _link_stall(fv: FaultVerdict, fault: PlannedFault, run: PlannedRun,
                hits: list[dict[str, Any]], tl: Timeline, run_dir: Path) -> list[str]:
    """The worker cut off from its peers is evicted (as unreachable) within the step
    deadline + one step + 5 s of its links' cut (a cut link stalls at the step's next
    collective, up to a step later); no one else (the healthy-eviction check). At two
    ranks, the generation is built again on fresh links in that time instead."""
    inj = hits[0]
    seg, name = int(inj["incarnation"]), inj.get("worker")
    t0 = float(tl.fired[inj["id"]]["t"])
    limit = tl.deadline(t0, seg) + tl.deadline(t0, seg, factor=1.0, floor_s=0.0) + STALL_SLACK_S
    if _two_rank_cut(inj, tl, run):
        rebuilt = [r for r in tl.in_segment(seg, "fault") if float(r["t"]) >= t0
                   and not r.get("worker") and "stalled link" in str(r.get("message", ""))]
        fv.bounds.append(Bound("link_evicted",
                               round(float(rebuilt[0]["t"]) - t0, 4) if rebuilt else None,
                               round(limit, 4), "two ranks: the generation built again on "
                               "fresh links"))
        if not rebuilt:
            return ["the stalled link at two ranks is not in the report"]
        fv.detect_s = round(float(rebuilt[0]["t"]) - t0, 4)
        commit = tl.first_commit_after(float(rebuilt[0]["t"]), seg)
        if commit is None:
            return ["the generation built again after the stalled link committed no step"]
        fv.recover_s.append(round(commit.t - t0, 4))
        return []
    evicted = [float(r["t"]) for r in tl.in_segment(seg, "fault") if float(r["t"]) >= t0
               and name in str(r.get("worker") or "").split(",")]
    fv.bounds.append(Bound("link_evicted", round(min(evicted) - t0, 4) if evicted else None,
                           round(limit, 4), f"the cut-off {name} evicted as unreachable"))
    return []


def _fleet(fv: FaultVerdict, fault: PlannedFault, run: PlannedRun, hits: list[dict[str, Any]],
           tl: Timeline, run_dir: Path) -> list[str]:
    """Every member preempted: nothing may be lost. Where the state left with them (a
    restore followed), a save of the step in hand must have started within a second of the
    notice and committed, and the restore is of it; where a replica outside the fleet kept
    it (a spare that took a member's place), training goes on from it."""
    inj = hits[0]
    seg = int(inj["incarnation"])
    t0 = float(tl.fired[inj["id"]]["t"])
    in_hand = tl.done_before(t0, seg)
    commit = tl.first_commit_after(t0 + float(inj.get("grace_s", 0.0)), seg)
    if commit is None:
        return ["training never went on after the fleet's preemption"]
    fv.recover_s.append(round(commit.t - t0, 4))
    lost = max(0, in_hand - commit.step)
    fv.lost_steps = lost
    restored = [r for r in tl.in_segment(seg, "restore") if t0 <= float(r["t"]) <= commit.t]
    if not restored and commit.segment == seg:
        fv.outcome = "a replica outside the fleet kept the state"
        fv.bounds.append(Bound("lost_steps", lost, 0, "the fleet's preemption, the state kept"))
        return []
    # This fleet's save: between its notices and the step that closed it (a later fleet's
    # preemption has its own).
    saves = [r for r in tl.in_segment(seg, "checkpoint_saved")
             if t0 <= float(r["t"]) <= commit.t and r.get("reason") == "preemption"]
    if not saves and tl.newest_durable(t0, in_hand) == in_hand:
        # The step in hand was saved before the notices (an interval save): nothing to snapshot.
        fv.outcome = "the step in hand was saved before the notices"
        fv.bounds.append(Bound("lost_steps", lost, 0, "the fleet's preemption, already saved"))
        return []
    started = [r for r in tl.in_segment(seg, "checkpoint_started")
               if t0 <= float(r["t"]) <= commit.t and r.get("reason") == "preemption"]
    start_t = (float(started[0]["t"]) if started else
               tl.save_started_t(saves[0]) if saves else None)
    fv.bounds.append(Bound("notice_to_snapshot_1s",
                           None if start_t is None else round(start_t - t0, 4), NOTICE_S,
                           f"notice to every member to the snapshot of step {in_hand}"))
    limit = 0 if saves else in_hand - tl.newest_durable(t0, in_hand)
    fv.bounds.append(Bound("lost_steps", lost, max(0, limit),
                           "the fleet's preemption: steps committed before it and again after"))
    if not saves:
        return [f"no save of the step in hand ({in_hand}) committed after the notice to "
                "every member, and the state left with them"]
    return []


def _secondary(fv: FaultVerdict, fault: PlannedFault, run: PlannedRun,
               hits: list[dict[str, Any]], tl: Timeline,
               run_dir: Path) -> tuple[list[str], dict[str, Any] | None]:
    """A compound fault's second half: the problems so far and its firing (None: never)."""
    problems = _second_half(fv, fault, run, hits, tl, run_dir)
    sec = [i for i in hits if i["role"] == "secondary"]
    return problems, (tl.fired[sec[0]["id"]] if sec else None)


def _preempt_during_save(fv: FaultVerdict, fault: PlannedFault, run: PlannedRun,
                         hits: list[dict[str, Any]], tl: Timeline, run_dir: Path) -> list[str]:
    problems, hit = _secondary(fv, fault, run, hits, tl, run_dir)
    if hit is None:
        return problems
    import re

    m = re.search(r"step_(\d{9,})", str(hit.get("path", "")))
    if m is None:
        return [*problems, "the preempted write names no step"]
    step = int(m.group(1))
    saved = [r for r in tl.after(float(hit["t"]), "checkpoint_saved") if int(r["step"]) == step]
    if not saved:
        failed = [r for r in tl.after(float(hit["t"]), "checkpoint_failed")
                  if int(r["step"]) == step]
        why = f": {failed[0].get('error')}" if failed else ""
        problems.append(f"the save of step {step} its writer was writing when preempted never "
                        f"committed{why}")
    return problems


def _starting(fv: FaultVerdict, fault: PlannedFault, run: PlannedRun,
              hits: list[dict[str, Any]], tl: Timeline, run_dir: Path) -> list[str]:
    problems, hit = _secondary(fv, fault, run, hits, tl, run_dir)
    if hit is None:
        return problems
    event = "spare_ready" if fault.kind == "kill_spare" else "replacement_ready"
    later = [r for r in tl.after(float(hit["t"]), event) if r.get("worker") != hit.get("worker")]
    if later:
        fv.figures["restart_s"] = round(float(later[0]["t"]) - float(hit["t"]), 3)
    else:
        problems.append(f"after {hit.get('worker')} was killed in its start, no {event} "
                        "followed (it was never started again)")
    return problems


def _final_save(fv: FaultVerdict, fault: PlannedFault, run: PlannedRun,
                hits: list[dict[str, Any]], tl: Timeline, run_dir: Path) -> list[str]:
    problems = _second_half(fv, fault, run, hits, tl, run_dir)
    sec = [i for i in hits if i["role"] == "secondary"]
    if sec:
        t = float(tl.fired[sec[0]["id"]]["t"])
        if not [r for r in tl.after(t, "checkpoint_saved") if int(r["step"]) == run.steps]:
            problems.append(f"the final save (step {run.steps}) never committed after its "
                            "writer was killed")
    return problems


def _disk_full(fv: FaultVerdict, fault: PlannedFault, run: PlannedRun,
               hits: list[dict[str, Any]], tl: Timeline, run_dir: Path) -> list[str]:
    if fault.variant != "checkpoints":
        return []
    from planaria.campaign import storage_faults

    hit = {r.get("path", "") for r in storage_faults.fired(run_dir / "control")
           if r.get("id") == hits[0]["id"]}  # the files the full disk failed
    left = [p for p in partial_saves(run_dir / "checkpoints")
            if any(str(h).startswith(p + "/") for h in hit)]
    if left:
        return [f"{len(left)} partial checkpoint directories left behind ({', '.join(left[:2])})"]
    return []


def _ray_process(fv: FaultVerdict, fault: PlannedFault, run: PlannedRun,
                 hits: list[dict[str, Any]], tl: Timeline, run_dir: Path) -> list[str]:
    """The job ended with an error naming what died (then the job started again resumed),
    or it outlived the loss and finished (a short run: Ray's own deadline had not come);
    either way no process is left behind (the run-level check)."""
    inj = hits[0]
    seg = int(inj["incarnation"])
    t0 = float(tl.fired[inj["id"]]["t"])
    problems = []
    ends = tl.in_segment(seg, "run_end")
    words = _NAMES[fault.kind]
    job = next((j for j in tl.jobs if j.get("incarnation") == seg), None)
    if job is not None and job.get("ended_t") is not None:
        fv.figures["end_s"] = round(float(job["ended_t"]) - t0, 3)
    if _outlived(tl, seg):
        fv.outcome = "the job outlived it and finished"
        return []
    fv.outcome = "the job ended and was started again"
    if not ends:
        problems.append("the job ended without a run_end record")
    elif not any(w in str(ends[-1].get("error") or "").lower() for w in words):
        problems.append(f"the job's end names neither of {', '.join(words)} "
                        f"(status {ends[-1].get('status')}: {ends[-1].get('error')})")
    return problems


def _outlived(tl: Timeline, seg: int) -> bool:
    """The job's process of incarnation ``seg`` finished (exit code 0), none after it."""
    job = next((j for j in tl.jobs if j.get("incarnation") == seg), None)
    return job is not None and job.get("rc") == 0 and seg + 1 >= len(tl.segments)


_KIND_CHECKS: dict[str, Callable[..., list[str]]] = {
    "kill_rerun": _second_half, "kill_join": _second_half, "kill_save": _second_half,
    "link_stall": _link_stall,
    "kill_restore": _second_half, "kill_resumed": _second_half,
    "storage_write": _storage_write, "bad_sample": _bad_sample, "stall": _stall,
    "fleet_preempt": _fleet, "preempt_during_save": _preempt_during_save,
    "kill_starting": _starting, "kill_spare": _starting, "kill_final_save": _final_save,
    "disk_full": _disk_full, "gcs_kill": _ray_process, "raylet_kill": _ray_process,
}


def _every_holder_lost(tl: Timeline, seg: int, t0: float, until: float) -> bool:
    """A restore between ``t0`` and ``until`` followed the loss of every worker of the
    generation that trained last before it (a kill of the last survivor while its
    replacement had not yet received the state): no replica kept the state, so the steps
    since the newest durable save may be lost."""
    restores = [r for r in tl.in_segment(seg, "restore") if t0 <= float(r["t"]) <= until]
    if not restores:
        return False
    at = float(restores[0]["t"])
    gens = [g for g in tl.in_segment(seg, "generation")
            if float(g["t"]) < at and g.get("reason") != "restore"]
    if not gens:
        return False
    since = float(gens[-1]["t"])
    lost = {w for r in tl.in_segment(seg, "fault") if since <= float(r["t"]) <= at
            for w in str(r.get("worker") or "").split(",")}
    return set(gens[-1].get("workers") or ()) <= lost


def _resumed(fv: FaultVerdict, fault: PlannedFault, seg: int, t0: float, tl: Timeline,
             run: PlannedRun) -> list[str]:
    """A whole-job fault: the job started again, restored the newest durable state and
    trained on."""
    if seg + 1 >= len(tl.segments):
        return ["no job resumed after the whole-job fault"]
    after = tl.segments[seg + 1]
    restores = [r for r in after if r.get("event") == "restore"]
    commits = [c for c in tl.commits if c.segment == seg + 1]
    done = tl.done_before(t0, seg)
    if commits:
        first_t, first_step = commits[0].t, commits[0].step
    elif restores and int(restores[0].get("step") or 0) >= run.steps:
        first_t, first_step = float(restores[0]["t"]), int(restores[0]["step"])  # all done
    else:
        return ["the resumed job committed no step"]
    fv.recover_s.append(round(first_t - t0, 4))
    lost = max(0, done - first_step)
    fv.lost_steps = (fv.lost_steps or 0) + lost
    limit = done - tl.newest_durable(t0, done)
    fv.bounds.append(Bound("lost_steps", lost, max(0, limit),
                           "the job started again: steps committed before and again after"))
    if not restores and first_step > 0:
        return ["the resumed job restored no checkpoint"]
    return []


# ---- run-level checks ----------------------------------------------------------------------


def _commit_bounds(tl: Timeline) -> list[Bound]:
    out = []
    for saved in (r for r in tl.events if r.get("event") == "checkpoint_saved"):
        done = tl.writers_done_t(saved)
        if done is None:
            continue  # its writes were not seen (a root outside faulty://)
        out.append(Bound("commit_0.2s", round(float(saved["t"]) - done, 4), COMMIT_S,
                         f"step {saved['step']} ({saved.get('reason')}): last writer to commit"))
    return out


def _run_checks(
    v: RunVerdict, run: PlannedRun, tl: Timeline, faulted: dict[int, set[str]],
    references: References, *, atol: float, rtol: float,
) -> None:
    from safetensors.torch import load_file

    run_dir = v.run_dir
    refs = references(run, run_dir)
    members = json.loads((run_dir / FINAL_FILE).read_text())["members"]
    for name in members:
        why = oracle.weights_differ(refs[run.steps], load_file(str(final_file(run_dir, name))),
                                    atol=atol, rtol=rtol)
        if why is not None:
            v.diverged = True
            v.reasons.append(f"{run_dir}: {name}'s final weights differ from the reference: "
                             f"{why}{_first_divergence(run_dir, run, refs, atol, rtol)}")
            break
    meta = json.loads((run_dir / META_FILE).read_text())
    plan = DataPlan(meta["num_samples"], meta["global_batch_size"], meta["seed"])
    skip = skipped_samples(run_dir)
    if run.shape.ledger:
        once = oracle.exactly_once(Ledger.committed(run_dir / "job"), plan, run.steps,
                                   skipped=Ledger.skipped(run_dir / "job"), skip=skip)
        if _ledger_dropped(tl) and not once.duplicated:
            # A full run dir cost the ledger records, and the run said so (run_end's
            # dropped): its holes are not the data's. The dataset's own load record and
            # the final weights below judge those steps.
            once.missing = 0
        v.duplicated, v.missing = once.duplicated, once.missing
        if not once.ok:
            v.reasons.append(f"{run_dir}: ledger: {once.duplicated} duplicated, {once.missing} "
                             f"missing ({'; '.join(once.problems[:3])})")
    loaded = oracle.loaded_once(read_loads(run_dir / "control"), plan, run.steps, skip=skip)
    v.duplicated += loaded.duplicated
    v.missing += loaded.missing
    if not loaded.ok:
        v.reasons.append(f"{run_dir}: the dataset's load record: {loaded.duplicated} served "
                         f"for another step, {loaded.missing} never loaded "
                         f"({'; '.join(loaded.problems[:3])})")
    for seg, name in oracle.healthy_evicted(tl.events, faulted):
        v.healthy_evicted.append(f"{seg}:{name}")
        v.reasons.append(f"{run_dir}: healthy worker {name} left the membership "
                         f"(segment {seg}): {_why_left(tl, seg, name)}")


def _ledger_dropped(tl: Timeline) -> bool:
    """Some incarnation of the job reported ledger records it could not write (a full disk)."""
    return any(int((r.get("dropped") or {}).get("ledger") or 0) > 0
               for seg in range(len(tl.segments)) for r in tl.in_segment(seg, "run_end"))


def _first_divergence(
    run_dir: Path, run: PlannedRun, refs: dict[int, dict[str, torch.Tensor]],
    atol: float, rtol: float,
) -> str:
    """Where the weights first differ, from the snapshots taken before each fault."""
    from safetensors.torch import load_file

    good = -1
    for steps in sorted(refs):
        path = snapshot_file(run_dir, steps)
        if not path.exists():
            continue
        if oracle.weights_differ(refs[steps], load_file(str(path)), atol=atol, rtol=rtol):
            return f"; first different after {steps} steps, {_suspects(run, good, steps)}"
        good = steps
    return f"; {_suspects(run, good, run.steps)}"


def _suspects(run: PlannedRun, good: int, bad: int) -> str:
    faults = [f"{f.index}:{f.kind}@{f.step}" for f in run.faults if good <= f.step < bad]
    return f"equal after {good}: fault {', '.join(faults)}" if faults else "before any fault"


def _why_left(tl: Timeline, seg: int, name: str) -> str:
    for rec in tl.segments[seg]:
        if rec.get("event") == "fault" and name in str(rec.get("worker") or "").split(","):
            return f"fault {rec.get('kind')} at step {rec.get('step')}: {rec.get('message')}"
        if rec.get("event") in ("drained", "hang_stack") and rec.get("worker") == name:
            return f"{rec['event']} at t={rec['t']:.3f}"
    return "dropped from a generation"
