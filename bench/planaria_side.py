"""planaria's side of the benchmarks: the shared workload as a TrainSpec, and runs that
return the same figures as ``bench.baselines.runners`` (same definitions, same clock).

- :func:`make_spec`: ``bench.common``'s model, dataset, Adam and data order as a
  :class:`planaria.TrainSpec`. ``common.loss_fn`` returns the *sum* of per-sample
  losses; planaria's ``TrainSpec.loss`` must return the *mean* over the
  micro-batch (the worker weights it by ``n / global_batch``), so it is divided
  by the micro-batch's length.
- :func:`run_planaria_steady`: ``steps`` steps at a fixed width; the step time a
  user sees (the driver loop's wall time per :meth:`planaria.Job.train_step`),
  the controller's own ``duration_s`` (dispatch → every result back), and the
  per-step time the slowest worker spent in its own timers
  (``data_wait_s + compute_s + reduce_s``, read from the step results).
- :func:`run_planaria_kill`: one SIGKILL through planaria's chaos plan
  (``kill:w1@stepK``), recovery figures computed from ``events.jsonl`` only.
- :func:`run_planaria_faults`: trains for a window while an outside kill harness
  (``bench/kill_harness.py``) SIGKILLs members again and again, finding them in
  ``events.jsonl`` (``bench/goodput.py``).

Every function starts (and shuts down) its own local Ray, so runs are independent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from bench import common  # noqa: E402
from bench.kill_harness import JsonlTail, KillHarness, Victim, step_period_s  # noqa: E402
from planaria.wire.reports import RunReport  # noqa: E402
from planaria.worker import Worker  # noqa: E402

__all__ = [
    "TimedWorker",
    "make_spec",
    "recovery_figures",
    "run_planaria_faults",
    "run_planaria_kill",
    "run_planaria_steady",
]


def _ensure_worker_path() -> None:
    """Ray workers inherit this environment: let them import ``bench.common`` too."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(_REPO) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(_REPO), *parts])


def _mean_loss(model: Any, batch: Any) -> Any:
    # common.loss_fn sums over the samples; planaria wants the micro-batch mean.
    return common.loss_fn(model, batch) / len(batch[1])


def make_spec(size: str = "small", micro_batch_size: int = common.MICRO_BATCH) -> Any:
    """The benchmark workload as a planaria TrainSpec (global batch 48, micro-batch 8 unless
    given: more replicas than 6 need smaller micro-batches, one at least per rank)."""
    import planaria

    return planaria.TrainSpec(
        model=functools.partial(common.make_model, size),
        optimizer=common.make_optimizer,
        loss=_mean_loss,
        dataset=functools.partial(common.make_dataset, size=size),
        collate=common.collate,
        global_batch_size=common.GLOBAL_BATCH,
        micro_batch_size=micro_batch_size,
        seed=common.SEED,
        name=f"bench-{size}",
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TimedRunReport(RunReport):
    """A run's report with the bench timings of :class:`TimedWorker` (the controller reads
    it as the run's report)."""

    apply_s: float
    """The run's settles (the update applied)."""
    call_s: float
    """The whole call, worker side."""


class TimedWorker(Worker):
    """planaria's worker with the bench timings (module level: Ray imports it by name).

    A worker applies a step's update (Adam) when it settles the step, once the step's
    reduction completed, outside the step's own timers; this adds ``apply_s`` (the run's
    settles) and ``call_s`` (the whole call, worker side) to the run's report
    (:class:`TimedRunReport`). Two ``perf_counter`` calls per settle and per run: nothing
    else changes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bench_settle_s = 0.0
        settle = self.commits.settle

        def timed(steps_done: int, skipped: int = -1, *, allow_behind: bool = False) -> None:
            t0 = time.perf_counter()
            settle(steps_done, skipped, allow_behind=allow_behind)
            self._bench_settle_s += time.perf_counter() - t0

        self.commits.settle = timed  # type: ignore[method-assign]

    def run(self, *args: Any, **kwargs: Any) -> TimedRunReport:
        t0 = time.perf_counter()
        self._bench_settle_s = 0.0
        out = super().run(*args, **kwargs)
        return TimedRunReport(
            **{f.name: getattr(out, f.name) for f in dataclasses.fields(RunReport)},
            apply_s=self._bench_settle_s, call_s=time.perf_counter() - t0)


@contextlib.contextmanager
def _timed_workers() -> Iterator[None]:
    """Workers started inside this block are :class:`TimedWorker` workers."""
    import planaria.control.pool as pool_module

    original = pool_module.Worker
    pool_module.Worker = TimedWorker
    try:
        yield
    finally:
        pool_module.Worker = original


_TIMES = ("data_wait_s", "compute_s", "reduce_s")


def _timed_job_class() -> type:
    """A Job that keeps the workers' own timings of runs of one step and its own wait for
    them (bench instrumentation only)."""
    from planaria import Job

    class TimedJob(Job):
        def start(self) -> None:
            super().start()
            assert self.calls is not None
            wait = self.calls.gather  # every wait for the workers goes through it

            def timed_gather(refs: dict[str, Any], *, deadline_s: float, step: int | None,
                             poll: Any = None) -> dict[str, Any]:
                t0 = time.perf_counter()
                results = wait(refs, deadline_s=deadline_s, step=step, poll=poll)
                self._note_times(results, time.perf_counter() - t0)
                return results

            self.calls.gather = timed_gather  # type: ignore[method-assign]

        def _note_times(self, results: dict[str, Any], gather_s: float) -> None:
            times = {}
            for name, r in results.items():
                if isinstance(r, TimedRunReport) and len(r.steps) == 1:
                    rec = r.steps[0]
                    times[name] = {**{k: float(getattr(rec, k)) for k in _TIMES},
                                   "apply_s": r.apply_s, "call_s": r.call_s,
                                   "gather_s": gather_s, "step": rec.step}
            if times:
                step_of = next(iter(times.values()))["step"]
                self.__dict__.setdefault("worker_times", {})[step_of] = times

    return TimedJob


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def run_planaria_steady(
    steps: int,
    size: str = "small",
    replicas: int = 2,
    threads: int = 1,
    *,
    warmup: int = 3,
    run_dir: str | os.PathLike | None = None,
    **run_options: Any,
) -> dict[str, Any]:
    """``steps`` steps on ``replicas`` workers, no faults; per-step medians after ``warmup``.
    ``driver``: ``"run_steps"`` (``fit``'s: runs up to the next boundary, see
    :func:`_run_autonomous`) or ``"train_step"`` (one step at a time: a run of one step
    each, whose breakdown follows). ``run_options`` are further RunConfig fields (e.g.
    ``overlap_reduction``).

    Per step under ``train_step`` (then the median over the steady steps), in ms:

    - ``step_ms``: the driver loop's wall time per ``train_step`` (boundary, the run's
      calls, wait for every result, commit bookkeeping): one step's latency;
    - ``duration_ms``: the controller's wait for the run's results (calls out → all back);
    - ``worker_ms``: the slowest worker's ``data_wait_s + compute_s + reduce_s``;
    - ``gap_ms``: ``step_ms - worker_ms``;
    - ``apply_ms``: the slowest worker's update apply (Adam; outside its timers);
    - ``worker_other_ms``: the rest of the slowest worker's ``run`` call (generation
      check, stop watch, prefetch submit, result);
    - ``transport_ms``: ``duration_ms`` minus the slowest worker's whole call: Ray
      dispatch, scheduling onto the actor, (de)serialisation, return, ``ray.wait``;
    - ``bookkeeping_ms``: ``step_ms - duration_ms``: step boundary (poll for
      replacements, chaos, checkpoint), loss and metrics, the event log, the run's keys;
    - ``controller_ms``: ``step_ms`` minus the slowest worker's
      ``data_wait + compute + reduce + apply``: what the controller adds to the
      work a DDP rank does in a step.
    """
    from planaria import RunConfig

    if steps <= warmup:
        raise ValueError(f"steps={steps} must exceed warmup={warmup}")
    _ensure_worker_path()
    rd = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="planaria_steady_"))
    driver = run_options.pop("driver", "train_step")
    config = RunConfig(steps=steps, replicas=replicas, run_dir=rd, threads_per_worker=threads,
                       **run_options)
    if driver == "run_steps":
        return _run_autonomous(config, size, warmup)
    with _timed_workers():
        job = _timed_job_class()(make_spec(size), config)
        job.start()
    wall: dict[int, float] = {}
    cpu = 0.0
    try:
        while job.steps_done < steps:
            t0, c0 = time.perf_counter(), time.process_time()
            result = job.train_step()  # no faults here: a Failure is a benchmark error
            wall[result.step] = time.perf_counter() - t0
            if result.step >= warmup:
                cpu += time.process_time() - c0
        job.commit_all()
    finally:
        job.close()
    times: dict[int, dict[str, dict[str, float]]] = getattr(job, "worker_times", {})
    per_step: dict[str, list[float]] = {
        k: []
        for k in (
            "step_ms",
            "duration_ms",
            "worker_ms",
            "gap_ms",
            "apply_ms",
            "worker_other_ms",
            "transport_ms",
            "bookkeeping_ms",
            "controller_ms",
        )
    }
    for s in sorted(wall):
        if s < warmup or s not in times:
            continue
        # The slowest worker: the one whose own work (incl. the apply) took longest.
        w = max(
            times[s].values(),
            key=lambda t: t["data_wait_s"] + t["compute_s"] + t["reduce_s"] + t["apply_s"],
        )
        timed = w["data_wait_s"] + w["compute_s"] + w["reduce_s"]
        call = max(t["call_s"] for t in times[s].values())
        duration = w["gather_s"]
        row = {
            "step_ms": wall[s],
            "duration_ms": duration,
            "worker_ms": timed,
            "gap_ms": wall[s] - timed,
            "apply_ms": w["apply_s"],
            "worker_other_ms": w["call_s"] - timed - w["apply_s"],
            "transport_ms": duration - call,
            "bookkeeping_ms": wall[s] - duration,
            "controller_ms": wall[s] - timed - w["apply_s"],
        }
        for k, v in row.items():
            per_step[k].append(v * 1000)
    out: dict[str, Any] = {f"{k}_median": _median(v) for k, v in per_step.items()}
    out.update(step_ms=per_step["step_ms"], replicas=replicas, size=size, run_dir=str(rd),
               controller_cpu_ms=cpu * 1000 / (steps - warmup), driver="train_step")
    return out


def _run_autonomous(config: Any, size: str, warmup: int) -> dict[str, Any]:
    """``run_planaria_steady`` in runs up to the next boundary (``Job.run_steps``, ``fit``'s):
    the steps after ``warmup`` in one run. ``step_ms``: the periods between rank 0's
    commits (the workers' clock); ``controller_cpu_ms``: the controller process's CPU over
    the run (its thread and Ray's) per step. The per-step breakdown is ``train_step``'s."""
    from planaria import Job

    job = Job(make_spec(size), config)
    job.start()
    try:
        job.run_steps(warmup)  # the first step alone (it names the metrics), then a run
        while job.steps_done < warmup:
            job.run_steps(warmup)
        c0, t0 = time.process_time(), time.perf_counter()
        while job.steps_done < config.steps:
            job.run_steps(config.steps)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        job.commit_all()
    finally:
        job.close()
    events = [json.loads(line) for line in (config.run_dir / "events.jsonl").read_text()
              .splitlines() if line.strip()]
    commits = {e["step"]: e["t"] for e in events if e["event"] == "step_committed"}
    periods = [(commits[s] - commits[s - 1]) * 1000 for s in sorted(commits)
               if s > warmup and s - 1 in commits]
    n = config.steps - warmup
    return {"step_ms_median": _median(periods), "step_ms": periods,
            "wall_per_step_ms": wall * 1000 / n, "controller_cpu_ms": cpu * 1000 / n,
            "replicas": config.replicas, "size": size, "run_dir": str(config.run_dir),
            "driver": "run_steps"}


def _transfer_gb_per_s(transfer: dict[str, Any], events: list[dict[str, Any]]
                       ) -> float | None:
    """A ``state_transfer``'s throughput: its record's own where the survivors waited for
    all of it; beside the step (its seconds: the model's part alone), its bytes over those
    seconds plus the rest's (the first joiner's ``state_received`` after it, the rest read
    while the step computes)."""
    if not transfer.get("beside"):
        return transfer.get("gb_per_s")
    rest = next((e for e in events if e["event"] == "state_received" and e.get("ok")
                 and e["t"] >= transfer["t"] and e.get("rest_s") is not None), None)
    if rest is None:
        return None
    seconds = float(transfer["seconds"]) + float(rest["rest_s"])
    return transfer["bytes"] / seconds / 1e9 if seconds > 0 else None


def recovery_figures(events: list[dict[str, Any]]) -> dict[str, Any]:
    """recover_s, back_s, lost_steps, join_s, transfer from one run's events (first kill).

    Same definitions as ``bench.baselines.runners``: ``t_kill`` is the chaos
    signal's time (the ``fault`` record's ``fault_t``), ``s_max`` the highest step
    committed before it, ``recover_s`` = kill → next committed step, ``back_s`` =
    kill → first commit of a step beyond ``s_max``, ``full_width_s`` = kill → first
    commit, of a step begun after the kill, at the width before it (the replacement
    in), ``lost_steps`` = steps
    ``<= s_max`` committed again after the kill.
    """
    faults = [e for e in events if e["event"] == "fault"]
    if not faults:
        raise RuntimeError("no fault in the event log: the kill did not happen")
    t_kill = float(faults[0]["fault_t"])
    commits = [e for e in events if e["event"] == "step_committed"]
    before = [e for e in commits if e["t"] <= t_kill]
    after = [e for e in commits if e["t"] > t_kill]
    s_max = max((e["step"] for e in before), default=-1)
    beyond = [e for e in after if e["step"] > s_max]
    full = max((e["width"] for e in before), default=None)
    # Begun after the kill: a step in flight at the kill that still committed at full width
    # (its reductions were done when the signal landed) is not the replacement's.
    at_full = [e for e in after if e["width"] == full and e["t"] - e["duration_s"] > t_kill]
    joined = [e for e in events if e["event"] == "joined"]
    transfer = [e for e in events if e["event"] == "state_transfer"]
    ready = [e for e in events if e["event"] == "replacement_ready"]
    detected = [e for e in events if e["event"] == "detected"]
    steady = [e["duration_s"] * 1000 for e in before[3:]]
    return {
        "s_max": s_max,
        "recover_s": after[0]["t"] - t_kill if after else None,
        "back_s": beyond[0]["t"] - t_kill if beyond else None,
        "full_width_s": at_full[0]["t"] - t_kill if at_full else None,
        "lost_steps": len({e["step"] for e in after if e["step"] <= s_max}),
        "detect_s": detected[0]["detect_s"] if detected else None,
        "replacement_s": ready[0]["replacement_s"] if ready else None,
        "join_s": joined[0]["join_s"] if joined else None,
        "joined_at_step": joined[0]["step"] if joined else None,
        "transfer_bytes": transfer[0]["bytes"] if transfer else None,
        "transfer_s": transfer[0]["seconds"] if transfer else None,
        "transfer_gb_per_s": _transfer_gb_per_s(transfer[0], events) if transfer else None,
        "step_ms_median": _median(steady),
        "final_width": commits[-1]["width"] if commits else None,
    }


def run_planaria_kill(
    steps: int,
    kill_at_step: int,
    size: str = "small",
    replicas: int = 3,
    threads: int = 1,
    *,
    victim: str = "w1",
    join_wait_s: float = 180.0,
    run_dir: str | os.PathLike | None = None,
    micro_batch_size: int = common.MICRO_BATCH,
    **run_options: Any,
) -> dict[str, Any]:
    """Resize policy; ``kill:<victim>@step<kill_at_step>`` through planaria's chaos plan.

    The loop is ``fit()``'s, except that from three steps before the end it
    waits (at most ``join_wait_s``, calling the step boundary every 0.2 s) for
    the replacement to join, so that a slow worker start cannot end the run
    before the hot-join it is meant to measure. The wait adds nothing to the
    figures: recovery is over by then, and ``join_s`` starts when the
    replacement is ready.
    """
    import planaria
    from planaria import RunConfig
    from planaria.observe.events import read_events

    _ensure_worker_path()
    rd = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="planaria_kill_"))
    config = RunConfig(steps=steps, replicas=replicas, run_dir=rd, threads_per_worker=threads,
                       **run_options)
    chaos = planaria.ChaosPlan.parse(f"kill:{victim}@step{kill_at_step}")
    job = planaria.Job(make_spec(size, micro_batch_size), config, chaos=chaos)
    with job:
        while job.steps_done < steps:
            try:
                if job.steps_done == steps - 3:  # the hot-join must happen within the run
                    job.wait_for_width(replicas, timeout_s=join_wait_s)
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
    out = recovery_figures(list(read_events(rd / "events.jsonl")))
    out.update(replicas=replicas, size=size, run_dir=str(rd))
    return out


_ENDLESS = 10**9  # steps and failures: the window's end stops the run, not a count


def planaria_victims(tail: JsonlTail) -> list[Victim]:
    """The members of the job's latest generation with their pids, from its event log
    alone: ``generation`` names the members, ``worker_started`` gives each worker's pid.
    A standby spare is in no generation until it takes a place."""
    rows = tail.read()
    pids = {r["worker"]: r["pid"] for r in rows
            if r.get("event") == "worker_started" and r.get("pid")}
    generations = [r for r in rows if r.get("event") == "generation"]
    if not generations:
        return []
    return [Victim(w, pids[w]) for w in generations[-1]["workers"] if w in pids]


def _commits(rows: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(r["step"], r["t"]) for r in rows if r.get("event") == "step_committed"]


def run_planaria_faults(
    duration_s: float,
    harness: KillHarness,
    size: str = "medium",
    replicas: int = 3,
    spares: int = 0,
    threads: int = 1,
    *,
    warmup: int = 3,
    max_run_s: float = 5.0,
    spare_wait_s: float = 300.0,
    run_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Resize policy, ``spares`` hot spares, trained for ``duration_s`` while ``harness``
    SIGKILLs members of the current generation.

    The loop is ``fit()``'s (``run_steps``, ``recovery.handle`` on a Failure), with
    the failure budget lifted (every kill is a failure) and bounded in time instead
    of steps: each call asks for the steps that fit in what is left of the window
    (at most ``max_run_s`` of them, at the step time seen so far), so the run stops
    near the window's end; a run's own cost is one call per worker. The window
    opens once the spares stand by and ``warmup`` steps are committed. Returns
    ``commits`` (``step``, ``wall``: rank 0's commit time, ``width``, ``started``:
    ``wall - duration_s``, when rank 0 began the step) from
    ``events.jsonl``, the window (``t0``, ``t1``), the harness's ``kills`` and
    ``skipped_kills``, and ``run_dir``.
    """
    import planaria
    from planaria import RecoveryPolicy, RunConfig
    from planaria.observe.events import read_events

    _ensure_worker_path()
    rd = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="planaria_faults_"))
    config = RunConfig(steps=_ENDLESS, replicas=replicas, spares=spares, run_dir=rd,
                       threads_per_worker=threads)
    policy = RecoveryPolicy(on_worker_lost="resize", min_replicas=1, max_failures=_ENDLESS)
    tail = JsonlTail(rd / "events.jsonl")

    def step_s() -> float | None:
        return step_period_s(_commits(tail.read()))

    def advance(job: Any, until: int) -> None:
        try:
            job.run_steps(until)
        except planaria.Failure as failure:
            job.recovery.handle(failure)

    with planaria.Job(make_spec(size), config, policy=policy) as job:
        if spares:
            job.wait_for_spares(timeout_s=spare_wait_s)
        while job.steps_done < warmup:
            advance(job, warmup)
        t0 = time.time()
        t1 = t0 + duration_s
        harness.start(t0, victims=lambda: planaria_victims(tail), step_s=step_s)
        try:
            while (now := time.time()) < t1:
                period = step_s() or 0.1
                advance(job, job.steps_done + max(1, int(min(t1 - now, max_run_s) / period)))
        finally:
            harness.stop()
    events = list(read_events(rd / "events.jsonl").events)
    commits = [{"step": e["step"], "wall": e["t"], "width": e["width"],
                "started": e["t"] - e["duration_s"]}
               for e in events if e["event"] == "step_committed"]
    return {"commits": commits, "t0": t0, "t1": t1, "kills": harness.kills,
            "skipped_kills": harness.skipped, "events": events, "replicas": replicas,
            "spares": spares, "size": size, "run_dir": str(rd)}
