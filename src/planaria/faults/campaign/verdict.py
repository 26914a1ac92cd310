"""One run's verdict: every planned fault recovered (or tolerated) or not, inside its
bounds or not, and the run-level checks.

Everything is measured by the campaign (:mod:`planaria.faults.campaign.timeline`): times
from ``control/fired.jsonl`` (the injection's own clock) to the event log's
records, lost steps from the committed steps themselves, never the runtime's own
``detect_s``/``recover_s``/``lost_steps``.

A fault of a *recovery* kind is recovered when it fired, every worker fault it
made shows in the event log as a ``fault`` record naming that worker (a NaN: a
``nonfinite_loss`` one) followed by a committed step, the kind's own condition
holds (see docs/campaign.md's table) and the run finished. A fault of a
*tolerated* kind (:data:`~planaria.faults.campaign.mix.TOLERATED_KINDS`: a straggler, a
write error, a bad or slow sample, a heavy micro-batch, a pause, a full disk)
needs no recovery: it is tolerated when nothing was evicted for it, the kind's
condition holds and the run finished; such faults are counted apart.

The bounds (:data:`BOUNDS`), each a number against a limit:

- ``detect_0.5s``: a member's death (SIGKILL) to its ``fault`` record, <= 0.5 s;
- ``kill_recovered``: a kill to the next committed step, <= its detection + one
  step (at the width after it) + the replacement's start (when the recovering
  step has it) + :data:`RECOVERY_SLACK_S`;
- ``lost_steps``: 0 while a replica holds the state; after a recovery that
  restores a checkpoint (:data:`~planaria.faults.campaign.mix.CHECKPOINT_KINDS`, or an
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

The run-level checks are :mod:`planaria.faults.campaign.oracle`'s (every member's final
weights against the independent reference, exactly-once from the ledger or the
dataset's load record, no healthy worker evicted) and no process left behind.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from planaria.data.plan import DataPlan, Ledger
from planaria.faults.campaign import oracle
from planaria.faults.campaign.dataset import read_loads
from planaria.faults.campaign.fault_judgement import judge_fault
from planaria.faults.campaign.injections import read_injections
from planaria.faults.campaign.job import FINAL_FILE, JOB_DIR, META_FILE, final_file, snapshot_file
from planaria.faults.campaign.kind_checks import RAY_PROCESS_KINDS
from planaria.faults.campaign.mix import PlannedRun
from planaria.faults.campaign.timeline import Timeline
from planaria.faults.campaign.verdict_record import (
    BOUNDS,
    COMMIT_S,
    Bound,
    FaultVerdict,
    RunVerdict,
)

__all__ = ["BOUNDS", "Bound", "FaultVerdict", "References", "RunVerdict", "check_run",
           "skipped_samples", "snapshot_counts"]

References = Callable[[PlannedRun, Path], dict[int, dict[str, torch.Tensor]]]
"""``references(run, run_dir)``: the reference's weights at every step count the run has a
file for (:func:`snapshot_counts`)."""


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
        from planaria.observe.metrics import summarize

        summary = summarize(job_dir)
        v.goodput_s, v.wall_s = summary.goodput_s, summary.wall_s
    faulted = _faulted(injections, tl)
    for fault in run.faults:
        mine = [i for i in injections if i["fault"] == fault.index]
        others = [(float(tl.fired[i["id"]]["t"]), {str(n) for n in i.get("victims") or []})
                  for i in injections if i["fault"] != fault.index and i["id"] in tl.fired]
        v.faults.append(judge_fault(fault, run, mine, tl, completed, run_dir, others))
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
        if inj["kind"] in RAY_PROCESS_KINDS:  # every worker of the job goes with it
            names |= set(inj.get("workers") or {})
            names |= {str(r["worker"]) for e in ("replacement_requested", "spare_requested")
                      for r in tl.in_segment(seg, e) if float(r["t"]) >= float(hit["t"])}
        if inj.get("expect_victim") == "reader" or inj.get("action") == "kill_starting":
            name = hit.get("worker") or tl.worker_of(seg, hit.get("pid"))
            if name:
                names.add(str(name))
        out.setdefault(seg, set()).update(n.split(".", 1)[0] for n in names)
    return out


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
