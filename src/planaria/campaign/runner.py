"""A campaign: the reference run, then the faulted runs, each checked, then one summary.

Every run is a job in its own process group (``python -m planaria.campaign.job``).
The reference trains the spec without faults and keeps the weights at every
step count the campaign's runs use (the step-length knob sleeps, it does not
change the numbers, so one reference serves every step length). A run whose
whole job was SIGKILLed is started again in the same run dir (incarnation 1)
and resumes from its checkpoints. After each run, the worker processes its
events name are SIGKILLed if still alive (a whole-job kill orphans them).
"""

from __future__ import annotations

import contextlib
import json
import os
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

from planaria.campaign.job import FINAL_FILE, job_config, reference_file
from planaria.campaign.mix import MixConfig, PlannedRun, plan_campaign
from planaria.campaign.verdict import RunVerdict, check_run
from planaria.config import check
from planaria.metrics import percentile

__all__ = ["CampaignConfig", "run_campaign", "summarize_campaign"]

RUN_MARKER = "PLANARIA_CAMPAIGN_RUN"
VERDICT_FILE = "verdict.json"
SUMMARY_KEYS = ("faults_injected", "recovered", "unrecovered", "diverged", "samples_duplicated",
                "samples_missing", "healthy_evicted", "mttr_p50_s", "mttr_p99_s", "goodput")


@dataclass(frozen=True, kw_only=True)
class CampaignConfig:
    """A campaign: what to train, the fault mix, where the run dirs go."""

    target: str
    """SCRIPT.py[:SPEC], as for ``planaria run``."""
    mix: MixConfig
    workdir: Path
    replicas: int = 3
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
        check(isinstance(self.target, str) and bool(self.target), "target", self.target,
              "SCRIPT.py[:SPEC]")
        check(self.replicas >= 2, "replicas", self.replicas,
              "an integer >= 2 (survivors must hold the state)")
        check(self.atol >= 0 and self.rtol >= 0, "atol", (self.atol, self.rtol), "tolerances >= 0")
        check(self.job_timeout_s > 0, "job_timeout_s", self.job_timeout_s, "seconds > 0")
        check(isinstance(self.parallel, int) and self.parallel >= 1, "parallel", self.parallel,
              "an integer >= 1 (runs at a time)")
        check(self.time_budget_s is None or self.time_budget_s > 0, "time_budget_s",
              self.time_budget_s, "seconds > 0, or None for no limit")
        object.__setattr__(self, "workdir", Path(self.workdir))
        if self.record is not None:
            object.__setattr__(self, "record", Path(self.record))


def run_campaign(config: CampaignConfig, *, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the campaign; prints a line per run and the failed checks; returns the summary."""
    runs = plan_campaign(config.mix)
    config.workdir.mkdir(parents=True, exist_ok=True)
    # The reference's weights at every step a fault is armed at, to tell where a run diverged.
    counts = {r.steps for r in runs} | {f.step for r in runs for f in r.faults}
    counts |= {f.step + k for r in runs for f in r.faults for k in range(1, config.mix.gap)}
    recorded = _recorded(config.record, runs)
    if recorded:
        out(f"{len(recorded)} of {len(runs)} runs taken from the record {config.record}")
    todo = [r for r in runs if r.index not in recorded]
    references = _reference(config, sorted(counts), out) if todo else {}
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
                f"faults={kinds}: {status} {took} ({run_dir})")
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
    """The campaign's summary (``SUMMARY_KEYS``, plus ``not_injected`` and ``fired_in_runs``:
    the faults that fired inside an autonomous run of steps)."""
    faults = [f for v in verdicts for f in v.faults]
    injected = [f for f in faults if f.injected]
    recover = [s for f in injected for s in f.recover_s]
    wall = sum(v.wall_s for v in verdicts)
    summary = {
        "faults_injected": len(injected),
        "recovered": sum(f.recovered for f in injected),
        "unrecovered": sum(not f.recovered for f in injected),
        "diverged": sum(v.diverged for v in verdicts),
        "samples_duplicated": sum(v.duplicated for v in verdicts),
        "samples_missing": sum(v.missing for v in verdicts),
        "healthy_evicted": sum(len(v.healthy_evicted) for v in verdicts),
        "mttr_p50_s": _round(percentile(recover, 0.5)),
        "mttr_p99_s": _round(percentile(recover, 0.99)),
        "goodput": _round(sum(v.goodput_s for v in verdicts) / wall if wall else None),
        "not_injected": len(faults) - len(injected),
        "fired_in_runs": sum(bool(f.in_run) for f in injected),
    }
    return summary


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _reference(
    config: CampaignConfig, steps: list[int], out: Callable[[str], None]
) -> dict[int, dict[str, torch.Tensor]]:
    """The reference weights at each step count (computed once per workdir, then reused)."""
    from safetensors.torch import load_file

    ref_dir = config.workdir / "reference"
    key = {"target": config.target, "replicas": config.replicas}
    key_file = ref_dir / "reference.json"
    fresh = key_file.exists() and json.loads(key_file.read_text()) == key
    if not (fresh and all(reference_file(ref_dir, n).exists() for n in steps)):
        t0 = time.time()
        error = _start(config, job_config(target=config.target, run_dir=ref_dir,
                                          steps=max(steps), replicas=config.replicas,
                                          step_s=0.0, run=None, snapshots=steps),
                       ref_dir, timeout_s=config.job_timeout_s, fresh=True)
        if error is not None:
            raise RuntimeError(f"the reference run failed ({ref_dir}): {error}")
        key_file.write_text(json.dumps(key))
        out(f"reference: {max(steps)} steps without faults in {time.time() - t0:.0f} s "
            f"({ref_dir})")
    return {n: load_file(str(reference_file(ref_dir, n))) for n in steps}


def _run(config: CampaignConfig, run: PlannedRun, run_dir: Path) -> str | None:
    """Runs one faulted run (and its resume after a whole-job kill); None if it finished."""
    timeout = config.job_timeout_s + run.steps * run.step_s * 3
    cfg = job_config(target=config.target, run_dir=run_dir, steps=run.steps,
                     replicas=config.replicas, step_s=run.step_s, run=run.to_json(),
                     checkpoint_every=config.mix.checkpoint_every)
    error = _start(config, cfg, run_dir, timeout_s=timeout, fresh=True)
    if error == "killed" and any(f.kind == "job_kill" for f in run.faults):
        cfg["incarnation"] = 1
        error = _start(config, cfg, run_dir, timeout_s=timeout, fresh=False)
    return error


def _start(
    config: CampaignConfig, cfg: dict[str, Any], run_dir: Path, *, timeout_s: float, fresh: bool
) -> str | None:
    if fresh and run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_file = run_dir / f"job-{cfg['incarnation']}.json"
    spec_file.write_text(json.dumps(cfg))
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])  # this planaria, not another one
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env[RUN_MARKER] = str(run_dir.resolve())  # the workers inherit it: see _clean_up
    with (run_dir / f"job-{cfg['incarnation']}.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "planaria.campaign.job", str(spec_file)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        _clean_up(run_dir, proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    if rc is None:
        return f"timed out after {timeout_s:.0f} s"
    if rc == -signal.SIGKILL:
        return "killed"
    if rc != 0 or not (run_dir / FINAL_FILE).exists():
        tail = (run_dir / f"job-{cfg['incarnation']}.log").read_text().strip().splitlines()
        return f"exit code {rc}: {tail[-1] if tail else ''}"
    return None


def _clean_up(run_dir: Path, pgid: int) -> None:
    """SIGKILLs what the job started and left behind: its process group, its workers."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    events = run_dir / "events.jsonl"
    pids: set[int] = set()
    if events.exists():
        for line in events.read_text().splitlines():
            if '"worker_started"' in line:
                with contextlib.suppress(ValueError, KeyError):
                    pids.add(int(json.loads(line)["pid"]))
    marker = f"{RUN_MARKER}={run_dir.resolve()}".encode()
    for pid in pids:
        try:  # only our own workers: a pid may have been reused since
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue
