"""A campaign: the faulted runs, each checked against the independent reference, then one
summary.

Every run is a job in its own process group (``python -m planaria.faults.campaign.job``).
Each run is judged against the spec trained by a plain single-process loop
(:mod:`planaria.faults.campaign.reference`) at every step count the run has weights for
(the step-length knob sleeps, it does not change the numbers, so one reference
serves every step length), leaving out the samples its ``bad_sample`` faults
made unreadable. A run whose job ended by a whole-job fault (killed, or ended
by a fault of Ray's own processes) is started again in the same run dir
(incarnation 1) and resumes from its checkpoints; after a controller kill at
once, the workers left as they are. After each job process ends (a controller
kill's: at the run's end), the run's processes still alive after
:data:`ORPHAN_WAIT_S` are recorded as left behind and SIGKILLed. A run with a
``disk_full`` fault of its run dir trains with its job dir on a small tmpfs
mounted for it (as root; the fault is skipped where the mount is refused).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from planaria.config import check
from planaria.faults.campaign import procs
from planaria.faults.campaign.job import FINAL_FILE, JOB_DIR, job_config
from planaria.faults.campaign.mix import (
    KINDS,
    WHOLE_JOB_KINDS,
    MixConfig,
    PlannedRun,
    plan_campaign,
)
from planaria.faults.campaign.timeline import JOBS_FILE
from planaria.faults.campaign.verdict import (
    BOUNDS,
    RunVerdict,
    check_run,
    skipped_samples,
    snapshot_counts,
)
from planaria.observe.metrics import percentile

__all__ = ["CampaignConfig", "run_campaign", "summarize_campaign"]

RUN_MARKER = procs.RUN_MARKER
VERDICT_FILE = "verdict.json"
SUMMARY_KEYS = ("faults_injected", "recovered", "tolerated", "unrecovered", "diverged",
                "samples_duplicated", "samples_missing", "healthy_evicted", "bound_violations",
                "processes_left", "mttr_p50_s", "mttr_p99_s", "goodput", "kinds")
ZERO_KEYS = ("unrecovered", "diverged", "samples_duplicated", "samples_missing",
             "healthy_evicted", "processes_left")
"""Every one of these (and every bound's violations) must be 0 for the exit code 0."""
ORPHAN_WAIT_S = 10.0
"""After a job's process ends, how long its processes may take to go before they count as
left behind."""
TMPFS_SIZE = "16m"
MAX_INCARNATIONS = 3


@dataclass(frozen=True, kw_only=True)
class CampaignConfig:
    """A campaign: the fault mix (with the configurations it draws), where the run dirs go."""

    mix: MixConfig
    workdir: Path
    atol: float = 1e-5
    rtol: float = 1e-4
    job_timeout_s: float = 900.0
    """A job that runs longer than this plus its steps' planned time is killed (unrecovered)."""
    parallel: int = 1
    """Runs at a time, each its own job (and Ray instance). Long steps are mostly sleep, so a
    campaign over long steps finishes sooner with a few at once; the checks do not change."""
    resume: bool = False
    """Runs that an earlier campaign in the workdir finished (the same planned run, a
    ``verdict.json`` in its dir) are not run again but judged again from their files; the
    rest are run: a campaign stopped part-way goes on where it stopped."""
    record: Path | None = None
    """A JSON-lines file, one line per finished run (its plan, error and verdict), appended as
    runs finish. Runs already in it (the same planned run) are taken from it and not run
    again: a campaign of record can go on in several parts, on the same commit, on machines
    that do not keep the run dirs (commit the file between parts)."""
    time_budget_s: float | None = None
    """No run starts after this many seconds; the summary counts the runs left."""

    def __post_init__(self) -> None:
        check(self.atol >= 0 and self.rtol >= 0, "atol", (self.atol, self.rtol), "tolerances >= 0")
        check(self.job_timeout_s > 0, "job_timeout_s", self.job_timeout_s, "seconds > 0")
        check(isinstance(self.parallel, int) and self.parallel >= 1, "parallel", self.parallel,
              "an integer >= 1 (runs at a time)")
        check(self.time_budget_s is None or self.time_budget_s > 0, "time_budget_s",
              self.time_budget_s, "seconds > 0, or None for no limit")
        object.__setattr__(self, "workdir", Path(self.workdir))
        if self.record is not None:
            object.__setattr__(self, "record", Path(self.record))


class References:
    """The independent reference's weights per run (its spec, its skipped samples), computed
    once per (spec, skipped samples, step counts) and one at a time (torch's threads are the
    process's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple[Any, ...], dict[int, dict[str, torch.Tensor]]] = {}

    def __call__(self, run: PlannedRun, run_dir: Path) -> dict[int, dict[str, torch.Tensor]]:
        from planaria.faults.campaign.reference import train_reference
        from planaria.faults.campaign.specs import build_spec

        skip = skipped_samples(run_dir)
        counts = snapshot_counts(run, run_dir)
        key = (run.shape.spec, tuple(sorted(skip.items())), tuple(counts))
        with self._lock:
            if key not in self._cache:
                spec = build_spec(run.shape.spec, control=None)
                self._cache[key] = train_reference(spec, counts, skip=skip)
                if len(self._cache) > 64:
                    self._cache.pop(next(iter(self._cache)))
            return self._cache[key]


def run_campaign(config: CampaignConfig, *, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the campaign; prints a line per run and the failed checks; returns the summary."""
    runs = plan_campaign(config.mix)
    config.workdir.mkdir(parents=True, exist_ok=True)
    recorded = _recorded(config.record, runs)
    if recorded:
        out(f"{len(recorded)} of {len(runs)} runs taken from the record {config.record}")
    todo = [r for r in runs if r.index not in recorded]
    references = References()
    lock = threading.Lock()
    deadline = None if config.time_budget_s is None else time.time() + config.time_budget_s

    def one(run: PlannedRun) -> RunVerdict | None:
        if deadline is not None and time.time() > deadline:
            return None  # past the time budget: left for a later part
        run_dir = config.workdir / f"run-{run.index:04d}"
        kept = _kept_run(run_dir, run) if config.resume else None
        t0 = time.time()
        error = _run(config, run, run_dir) if kept is None else kept[0]
        # A kept run is judged again from its files, by this oracle.
        verdict = check_run(run_dir, run, references, error=error, atol=config.atol,
                            rtol=config.rtol)
        if kept is None:
            _keep_run(run_dir, run, error, verdict)
        if config.record is not None:
            with lock:
                _append_record(config.record, run, error, verdict)
        kinds = ",".join(f.kind for f in run.faults)
        status = "ok" if verdict.ok else f"FAILED ({len(verdict.reasons)} checks)"
        took = "run by an earlier campaign" if kept else f"in {time.time() - t0:.0f} s"
        with lock:  # one run's lines together
            out(f"run {run.index + 1}/{len(runs)} step_s={run.step_s:g} steps={run.steps} "
                f"[{run.shape.describe()}] faults={kinds}: {status} {took} ({run_dir})")
            for reason in verdict.reasons:
                out(f"  {reason}")
        return verdict

    with ThreadPoolExecutor(max_workers=config.parallel) as pool:
        done = list(pool.map(one, todo))
    verdicts = [*recorded.values(), *(v for v in done if v is not None)]
    summary = summarize_campaign(sorted(verdicts, key=lambda v: v.index))
    summary["runs"] = len(runs)
    summary["runs_left"] = sum(v is None for v in done)
    return summary


def campaign_ok(summary: dict[str, Any]) -> bool:
    """Every zero count zero, every bound kept."""
    return (not any(summary[k] for k in ZERO_KEYS)
            and not any(summary["bound_violations"].values()))


def _recorded(record: Path | None, runs: list[PlannedRun]) -> dict[int, RunVerdict]:
    """The verdicts of this campaign's runs found in ``record`` (a line of another plan, or
    torn by a kill, is ignored)."""
    if record is None or not record.exists():
        return {}
    planned = {r.index: _plan_json(r) for r in runs}
    out: dict[int, RunVerdict] = {}
    for line in record.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            data = json.loads(line)
            verdict = RunVerdict.from_json(data["verdict"])
            if planned.get(verdict.index) == data["run"]:
                out[verdict.index] = verdict
    return out


def _plan_json(run: PlannedRun) -> Any:
    """The planned run as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(run.to_json()))


def _run_record(run: PlannedRun, error: str | None, verdict: RunVerdict) -> str:
    """A finished run as ``verdict.json`` and a line of the record hold it."""
    return json.dumps({"run": run.to_json(), "error": error, "verdict": verdict.to_json()})


def _append_record(record: Path, run: PlannedRun, error: str | None, verdict: RunVerdict) -> None:
    record.parent.mkdir(parents=True, exist_ok=True)
    line = _run_record(run, error, verdict)
    with record.open("a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _kept_run(run_dir: Path, run: PlannedRun) -> tuple[str | None] | None:
    """``(error,)`` of this very run, if an earlier campaign finished it; else None."""
    path = run_dir / VERDICT_FILE
    if not path.exists():
        return None
    with contextlib.suppress(ValueError, KeyError, TypeError):
        data = json.loads(path.read_text())  # torn, or without its error: run it again
        if data["run"] == _plan_json(run):
            return (data["error"],)
    return None


def _keep_run(run_dir: Path, run: PlannedRun, error: str | None, verdict: RunVerdict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f"{VERDICT_FILE}.tmp"
    tmp.write_text(_run_record(run, error, verdict))
    os.replace(tmp, run_dir / VERDICT_FILE)


def summarize_campaign(verdicts: list[RunVerdict]) -> dict[str, Any]:
    """The campaign's summary (``SUMMARY_KEYS``, plus ``not_injected``, ``skipped`` and
    ``fired_in_runs``: the faults that fired inside an autonomous run of steps).
    ``recovered`` counts the faults that needed a recovery and got it, ``tolerated`` those
    that needed none and did no harm (stragglers, write errors, bad or slow samples, heavy
    micro-batches, pauses, full disks); ``bound_violations`` counts, per bound, the
    measurements beyond it; ``kinds`` has per kind ``injected``, ``ok``, ``failed``."""
    faults = [f for v in verdicts for f in v.faults]
    injected = [f for f in faults if f.injected]
    recover = [s for f in injected if not f.tolerated for s in f.recover_s]
    wall = sum(v.wall_s for v in verdicts)
    violations = dict.fromkeys(BOUNDS, 0)
    for bound in [b for f in injected for b in f.bounds] + [b for v in verdicts for b in v.bounds]:
        if not bound.ok:
            violations[bound.name] = violations.get(bound.name, 0) + 1
    kinds: dict[str, dict[str, int]] = {}
    for f in faults:
        entry = kinds.setdefault(f.kind, {"injected": 0, "ok": 0, "failed": 0})
        if f.injected:
            entry["injected"] += 1
            entry["ok" if f.recovered and not f.violations else "failed"] += 1
    summary = {
        "faults_injected": len(injected),
        "recovered": sum(f.recovered for f in injected if not f.tolerated),
        "tolerated": sum(f.recovered for f in injected if f.tolerated),
        "unrecovered": sum(not f.recovered for f in injected),
        "diverged": sum(v.diverged for v in verdicts),
        "samples_duplicated": sum(v.duplicated for v in verdicts),
        "samples_missing": sum(v.missing for v in verdicts),
        "healthy_evicted": sum(len(v.healthy_evicted) for v in verdicts),
        "bound_violations": violations,
        "processes_left": sum(len(v.processes_left) for v in verdicts),
        "mttr_p50_s": _round(percentile(recover, 0.5)),
        "mttr_p99_s": _round(percentile(recover, 0.99)),
        "goodput": _round(sum(v.goodput_s for v in verdicts) / wall if wall else None),
        "kinds": {k: kinds[k] for k in KINDS if k in kinds},
        "not_injected": sum(not f.injected and f.skipped is None for f in faults),
        "skipped": sum(f.skipped is not None for f in faults),
        "fired_in_runs": sum(bool(f.in_run) for f in injected),
    }
    return summary


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


# ---- one run -------------------------------------------------------------------------------


def _run(config: CampaignConfig, run: PlannedRun, run_dir: Path) -> str | None:
    """Runs one faulted run (and its jobs started again after a whole-job fault); None if it
    finished."""
    timeout = config.job_timeout_s + run.steps * run.step_s * 3
    if run_dir.exists():
        _unmount(run_dir / JOB_DIR)
        shutil.rmtree(run_dir)
    (run_dir / JOB_DIR).mkdir(parents=True)
    if any(f.kind == "disk_full" and f.variant == "run_dir" for f in run.faults):
        _mount_tmpfs(run_dir / JOB_DIR)
    whole = {f.index for f in run.faults if f.kind in WHOLE_JOB_KINDS}
    error: str | None = None
    deferred = False
    try:
        for incarnation in range(MAX_INCARNATIONS):
            cfg = job_config(run_dir=run_dir, run=run.to_json(), incarnation=incarnation)
            started = time.time()
            error, rc = _start(cfg, run_dir, timeout_s=timeout)
            ended = time.time()
            cut = _whole_job_fault_in(run_dir, run, whole, started, ended)
            again = error is not None and cut is not None
            if again and cut == "controller_kill":
                deferred = True  # the workers are left as they are; judged at the run's end
                _record_job(run_dir, incarnation, rc, started, ended, {})
            else:
                _record_job(run_dir, incarnation, rc, started, ended, _leftovers(run_dir))
            if not again:
                break
    finally:
        if deferred:
            left = _leftovers(run_dir)
            if left:
                _record_job(run_dir, -1, None, time.time(), time.time(), left)
        _unmount(run_dir / JOB_DIR)
        if any(f.kind == "link_stall" for f in run.faults):
            from planaria.faults.campaign.netfilter import Chain, run_chain

            Chain(run_chain(run.index)).remove()  # the dropped flows' rules go with the run
    return error


def _whole_job_fault_in(run_dir: Path, run: PlannedRun, whole: set[int], started: float,
                        ended: float) -> str | None:
    """The kind of the whole-job fault that fired while this job ran, if one did."""
    from planaria.faults.campaign import storage_faults

    fired = {r["id"]: r for r in storage_faults.fired(run_dir / "control")}
    for fault in run.faults:
        if fault.index not in whole:
            continue
        hit = fired.get(f"r{run.index}f{fault.index}.primary")
        if hit is not None and started <= float(hit["t"]) <= ended + 1.0:
            if fault.kind == "kill_resumed" and fault.variant == "controller":
                return "controller_kill"
            return fault.kind
    return None


def _record_job(run_dir: Path, incarnation: int, rc: int | None, started: float,
                ended: float, left: dict[int, str]) -> None:
    with (run_dir / JOBS_FILE).open("a", encoding="utf-8") as f:
        f.write(json.dumps({"incarnation": incarnation, "rc": rc, "started_t": started,
                            "ended_t": ended, "left": {str(k): v for k, v in left.items()}})
                + "\n")


def _start(
    cfg: dict[str, Any], run_dir: Path, *, timeout_s: float
) -> tuple[str | None, int | None]:
    """Runs one job process; (None, 0) if it finished, else (why, its exit code)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_file = run_dir / f"job-{cfg['incarnation']}.json"
    spec_file.write_text(json.dumps(cfg))
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])  # this planaria, not another one
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env[RUN_MARKER] = str(run_dir.resolve())  # every process of the job inherits it
    env[procs.INCARNATION] = str(cfg["incarnation"])
    log_path = run_dir / f"job-{cfg['incarnation']}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "planaria.faults.campaign.job", str(spec_file)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    if rc is None:
        return f"timed out after {timeout_s:.0f} s", None
    if rc == -signal.SIGKILL:
        return "killed", rc
    if rc != 0 or not (run_dir / FINAL_FILE).exists():
        tail = log_path.read_text().strip().splitlines()
        return f"exit code {rc}: {tail[-1] if tail else ''}", rc
    return None, rc


def _leftovers(run_dir: Path) -> dict[int, str]:
    """The run's processes still alive :data:`ORPHAN_WAIT_S` after its job ended (then
    SIGKILLed, so that the next job starts clean)."""
    end = time.monotonic() + ORPHAN_WAIT_S
    left = procs.marked(run_dir)
    while left and time.monotonic() < end:
        time.sleep(0.25)
        left = procs.marked(run_dir)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return left


def _mount_tmpfs(path: Path) -> bool:
    """Mounts a small tmpfs at ``path`` (a run dir whose disk a fault fills); False (and the
    fault is skipped, saying why) where mounting is refused (not root, no privilege)."""
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs",
                        str(path)], check=True, capture_output=True, timeout=30)
        return True
    except (OSError, subprocess.SubprocessError):
        return False


def _unmount(path: Path) -> None:
    """Keeps a tmpfs run dir's files (copied out) and unmounts it."""
    from planaria.faults.campaign.full_disks import BALLAST

    if not _is_mount(path):
        return
    with contextlib.suppress(FileNotFoundError):
        os.remove(path / BALLAST)
    copy = path.with_name(f"{path.name}.kept")
    shutil.copytree(path, copy, dirs_exist_ok=True)
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True, timeout=30)
    shutil.copytree(copy, path, dirs_exist_ok=True)
    shutil.rmtree(copy, ignore_errors=True)


def _is_mount(path: Path) -> bool:
    target = str(Path(path).resolve())
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        return any(line.split()[1] == target for line in f if len(line.split()) > 1)
    return False
