"""Each fault kind's own condition (docs/campaign.md's table): what must have happened
for a fault of that kind, beyond the report naming the faults it made and a step
committed after them (:mod:`planaria.faults.campaign.fault_judgement`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Protocol

from planaria.faults.campaign import storage_faults
from planaria.faults.campaign.mix import PlannedFault, PlannedRun
from planaria.faults.campaign.timeline import Timeline, partial_saves
from planaria.faults.campaign.verdict_record import NOTICE_S, STALL_SLACK_S, Bound, FaultVerdict

__all__ = ["ABSORBED", "KIND_CHECKS", "RAY_PROCESS_KINDS", "KindCheck", "absorbed",
           "no_check", "outlived", "two_rank_cut"]

RAY_PROCESS_KINDS = {"gcs_kill": ("gcs",), "raylet_kill": ("raylet",)}
"""The kinds that kill one of Ray's own processes, and the words naming it in the job's end
(every worker of the job goes with it)."""


class KindCheck(Protocol):
    """A kind's own condition: the problems found (none: it holds). It may fill in the
    verdict's measured figures (``bounds``, ``recover_s``, ``outcome``, ``figures``) from
    ``hits`` (the fault's armings that fired) and the run's timeline."""

    def __call__(self, fv: FaultVerdict, fault: PlannedFault, run: PlannedRun,
                 hits: list[dict[str, Any]], tl: Timeline, run_dir: Path) -> list[str]: ...


def no_check(fv: FaultVerdict, fault: PlannedFault, run: PlannedRun,
             hits: list[dict[str, Any]], tl: Timeline, run_dir: Path) -> list[str]:
    """A kind with no condition of its own."""
    return []


ABSORBED = "its step failed for another fault first: nothing non-finite was reduced"


def absorbed(t0: float, seg: int, tl: Timeline) -> bool:
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


def two_rank_cut(inj: dict[str, Any], tl: Timeline, run: PlannedRun) -> bool:
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
    if two_rank_cut(inj, tl, run):
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
    words = RAY_PROCESS_KINDS[fault.kind]
    job = next((j for j in tl.jobs if j.get("incarnation") == seg), None)
    if job is not None and job.get("ended_t") is not None:
        fv.figures["end_s"] = round(float(job["ended_t"]) - t0, 3)
    if outlived(tl, seg):
        fv.outcome = "the job outlived it and finished"
        return []
    fv.outcome = "the job ended and was started again"
    if not ends:
        problems.append("the job ended without a run_end record")
    elif not any(w in str(ends[-1].get("error") or "").lower() for w in words):
        problems.append(f"the job's end names neither of {', '.join(words)} "
                        f"(status {ends[-1].get('status')}: {ends[-1].get('error')})")
    return problems


def outlived(tl: Timeline, seg: int) -> bool:
    """The job's process of incarnation ``seg`` finished (exit code 0), none after it."""
    job = next((j for j in tl.jobs if j.get("incarnation") == seg), None)
    return job is not None and job.get("rc") == 0 and seg + 1 >= len(tl.segments)


KIND_CHECKS: dict[str, KindCheck] = {
    "kill_rerun": _second_half, "kill_join": _second_half, "kill_save": _second_half,
    "link_stall": _link_stall,
    "kill_restore": _second_half, "kill_resumed": _second_half,
    "storage_write": _storage_write, "bad_sample": _bad_sample, "stall": _stall,
    "fleet_preempt": _fleet, "preempt_during_save": _preempt_during_save,
    "kill_starting": _starting, "kill_spare": _starting, "kill_final_save": _final_save,
    "disk_full": _disk_full, "gcs_kill": _ray_process, "raylet_kill": _ray_process,
}

