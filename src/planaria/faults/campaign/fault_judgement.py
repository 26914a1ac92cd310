"""One planned fault judged from the run's timeline: fired, reported, recovered (or
tolerated), within its bounds (see :mod:`planaria.faults.campaign.verdict`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planaria.faults.campaign.kind_checks import (
    ABSORBED,
    KIND_CHECKS,
    RAY_PROCESS_KINDS,
    absorbed,
    no_check,
    outlived,
    two_rank_cut,
)
from planaria.faults.campaign.mix import (
    CHECKPOINT_KINDS,
    TOLERATED_KINDS,
    WHOLE_JOB_KINDS,
    PlannedFault,
    PlannedRun,
)
from planaria.faults.campaign.timeline import Commit, Timeline
from planaria.faults.campaign.verdict_record import DETECT_S, RECOVERY_SLACK_S, Bound, FaultVerdict

__all__ = ["every_holder_lost", "judge_fault"]


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


def judge_fault(
    fault: PlannedFault, run: PlannedRun, mine: list[dict[str, Any]], tl: Timeline,
    completed: bool, run_dir: Path, others: list[tuple[float, set[str]]],
) -> FaultVerdict:
    """``fault``'s verdict from its records (``mine``: its armings) and the timeline;
    ``others``: the firing times and victims of the run's other faults."""
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
        if inj.get("expect") and not two_rank_cut(inj, tl, run):
            problems += _reported(fv, fault, inj, tl, run)
    problems += KIND_CHECKS.get(fault.kind, no_check)(fv, fault, run, hits, tl, run_dir)
    if fault.kind in WHOLE_JOB_KINDS:
        whole = next((i for i in hits if i["role"] == "primary"), first)
        if not (fault.kind in RAY_PROCESS_KINDS and outlived(tl, int(whole["incarnation"]))):
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
    if not cands and nan and absorbed(t0, seg, tl):
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
                or every_holder_lost(tl, seg, float(rec["t"]), commit.t))
    limit = done - tl.newest_durable(t0, done) if restores else 0
    fv.bounds.append(Bound("lost_steps", lost, max(0, limit),
                           f"{what}: steps committed before it and again after"))
    if killed and rec.get("kind") == "worker_lost" and commit.segment == seg and not later:
        fv.bounds.append(Bound("kill_recovered", round(recover, 4),
                               _recovery_limit(detect, name, t0, commit, tl, run),
                               f"{what}: fired to the next committed step"))
    return []


def _recovery_limit(detect: float, victim: str | None, t0: float, commit: Commit,
                    tl: Timeline, run: PlannedRun) -> float:
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




def every_holder_lost(tl: Timeline, seg: int, t0: float, until: float) -> bool:
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


