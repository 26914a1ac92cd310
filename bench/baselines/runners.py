"""Launch the baselines as real processes on 127.0.0.1 and turn their logs into figures.

Every function starts its processes in new sessions, bounds every wait by a
deadline (``timeout_s``), and kills every process it started (and their
descendants, found through ``/proc``) in ``finally``. Ports are free ports on
127.0.0.1 picked at call time.

Recovery figures, the same definitions for every baseline (times are
``time.time()`` in the runner and the workers; same machine, same clock):

- ``t_kill``: when the runner sent SIGKILL to one worker process.
- ``s_max``: the highest step committed before ``t_kill`` (the step reached).
- ``recover_s``: ``t_kill`` → the first step committed after it (any step, for
  torchrun the first step after resuming from the checkpoint; for torchft a
  survivor's next committed step).
- ``back_s``: ``t_kill`` → the first commit after it of a step beyond
  ``s_max``, i.e. the job is back where it was and makes new progress. For
  torchrun that is after recomputing the steps since the checkpoint; torchft's
  survivors never go back, so ``back_s == recover_s`` unless a step was lost.
- ``lost_steps``: steps ``<= s_max`` that were committed again after the kill
  (work that had to be recomputed).
- ``step_ms_median``: median step time of the steady steps before the kill
  (warm-up steps left out).

torchft's runners are in ``bench/baselines/torchft_runners.py``, the process handling they
all share in ``bench/baselines/launch.py``.

``run_torchrun_faults`` and ``run_torchft_faults`` (for ``bench/goodput.py``)
instead train for a window while an outside harness kills workers again and
again, and return the raw records (committed steps, kills) from which that bench
computes the same figures per kill.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.baselines import launch
from bench.kill_harness import JsonlTail, KillHarness, Victim, step_period_s

__all__ = [
    "run_ddp_steady",
    "run_hsdp_steady",
    "run_torchrun_faults",
    "run_torchrun_kill",
]


# ---------------------------------------------------------------- torchrun and DDP


# A port picked free can be taken before torchrun binds it (Ray's workers bind ports
# of their own at any time); such a launch is retried on other ports.
_PORT_TAKEN = ("address already in use", "eaddrinuse")
_LAUNCHES = 3


def _run_torchrun_to_end(
    cmd: Callable[[], list[str]], env: dict[str, str], log: Path, timeout_s: float, what: str,
    script: str, records: Path,
) -> None:
    """Runs a fault-free torchrun job to its end; a launch that lost its port to another
    process is retried (up to ``_LAUNCHES`` launches), anything else raises at once."""
    for attempt in range(1, _LAUNCHES + 1):
        start = log.stat().st_size if log.exists() else 0
        proc = launch.spawn(cmd(), env, log)
        try:
            launch.wait_exit([proc], time.time() + timeout_s, what, log)
            return
        except RuntimeError:
            with open(log, "rb") as f:
                f.seek(start)
                printed = f.read().decode("utf-8", errors="replace").lower()
            if attempt == _LAUNCHES or not any(m in printed for m in _PORT_TAKEN):
                raise
        finally:
            launch.kill_tree(proc, grace_s=2.0)
            launch.kill_logged(records, script)


def _torchrun(nproc: int, max_restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{launch.free_port()}",
        f"--rdzv-id=bench{os.getpid()}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
    ]


# ---------------------------------------------------------------- runners


def run_ddp_steady(
    steps: int,
    size: str = "small",
    nproc: int = 2,
    threads: int = 1,
    *,
    warmup: int = 3,
    timeout_s: float = 300.0,
    workdir: str | os.PathLike | None = None,
    device: str = "cpu",
    backend: str = "gloo",
    prefetch: str = "ahead",
) -> dict[str, Any]:
    """Plain DDP under torchrun for ``steps`` steps; rank 0's step times (``device``,
    ``backend`` and ``prefetch``: ``ddp_train.py``'s ``--device``, ``--backend`` and
    ``--prefetch``).

    Returns ``{"step_ms_median", "step_ms" (steady steps, warm-up left out), "period_ms"
    (between consecutive steady steps' ends), "nproc", "size", "log"}``.
    """
    if steps <= warmup:
        raise ValueError(f"steps={steps} must exceed warmup={warmup}")
    wd = launch.workdir_path(workdir, "ddp_steady_")
    log = launch.fresh_log(wd / "ddp.jsonl")
    args = [
        str(launch.HERE / "ddp_train.py"),
        f"--steps={steps}",
        f"--size={size}",
        f"--threads={threads}",
        f"--warmup={warmup}",
        f"--out={log}",
        f"--device={device}",
        f"--backend={backend}",
        f"--prefetch={prefetch}",
    ]
    _run_torchrun_to_end(
        lambda: [*_torchrun(nproc), *args],
        launch.child_env(threads, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
        wd / "torchrun.log", timeout_s, "ddp_train", "ddp_train.py", log,
    )
    rows = [r for r in launch.read_jsonl(log) if r["event"] == "step" and not r["warmup"]]
    step_ms = [r["step_ms"] for r in rows]
    return {
        "step_ms_median": launch.median_or_none(step_ms),
        "step_ms": step_ms,
        # the time between two steps' ends (the loop's work between steps in it)
        "period_ms": [(b["wall"] - a["wall"]) * 1000 for a, b in itertools.pairwise(rows)],
        "nproc": nproc,
        "size": size,
        "log": str(log),
    }


def run_hsdp_steady(
    steps: int,
    replicas: int = 2,
    shards: int = 2,
    threads: int = 1,
    *,
    dim: int = 128,
    layers: int = 2,
    global_batch: int = 32,
    micro_batch: int = 4,
    warmup: int = 3,
    sync: str = "step",
    global_loss: bool = False,
    timeout_s: float = 300.0,
    workdir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Plain FSDP2 HSDP (``hsdp_train.py``: a ``(replicas, shards)`` mesh, ``tiny_gpt`` of
    ``dim`` x ``layers``) under ``torchrun --nproc_per_node=replicas*shards``; rank 0's step
    times.

    Returns ``{"step_ms_median", "step_ms" (steady steps, warm-up left out), "losses"
    (every step's, by step), "nproc", "log"}``.
    """
    if steps <= warmup:
        raise ValueError(f"steps={steps} must exceed warmup={warmup}")
    wd = launch.workdir_path(workdir, "hsdp_steady_")
    log = launch.fresh_log(wd / "hsdp.jsonl")
    nproc = replicas * shards
    args = [
        str(launch.HERE / "hsdp_train.py"),
        f"--steps={steps}",
        f"--warmup={warmup}",
        f"--replicas={replicas}",
        f"--shards={shards}",
        f"--dim={dim}",
        f"--layers={layers}",
        f"--global-batch={global_batch}",
        f"--micro-batch={micro_batch}",
        f"--threads={threads}",
        f"--sync={sync}",
        f"--out={log}",
        *(["--global-loss"] if global_loss else []),
    ]
    _run_torchrun_to_end(
        lambda: [*_torchrun(nproc), *args],
        launch.child_env(threads, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
        wd / "torchrun.log", timeout_s, "hsdp_train", "hsdp_train.py", log,
    )
    rows = [r for r in launch.read_jsonl(log) if r["event"] == "step"]
    step_ms = [r["step_ms"] for r in rows if not r["warmup"]]
    return {
        "step_ms_median": launch.median_or_none(step_ms),
        "step_ms": step_ms,
        "losses": {r["step"]: r["loss"] for r in rows},
        "nproc": nproc,
        "log": str(log),
    }


def run_torchrun_kill(
    steps: int,
    kill_at_step: int,
    size: str = "small",
    nproc: int = 3,
    *,
    threads: int = 1,
    ckpt_every: int = 20,
    max_restarts: int = 3,
    warmup: int = 3,
    timeout_s: float = 300.0,
    workdir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """DDP + checkpoints under ``torchrun --max-restarts``; SIGKILL one worker mid-run.

    When rank 0 logs step ``kill_at_step``, the runner SIGKILLs the worker of the
    last rank (a worker, never the agent); torchrun restarts all workers, which
    resume from the latest checkpoint. Returns the figures of the module
    docstring plus ``restart_s`` (kill → the restarted workers' ``start``
    record), ``resume_step`` and ``ckpt_every``.
    """
    if not warmup < kill_at_step < steps - 1:
        raise ValueError("need warmup < kill_at_step < steps - 1")
    wd = launch.workdir_path(workdir, "ddp_restart_")
    log = launch.fresh_log(wd / "ddp_restart.jsonl")
    cmd = [
        *_torchrun(nproc, max_restarts),
        str(launch.HERE / "ddp_ckpt_restart.py"),
        f"--steps={steps}",
        f"--size={size}",
        f"--threads={threads}",
        f"--warmup={warmup}",
        f"--ckpt={wd / 'ckpt.pt'}",
        f"--ckpt-every={ckpt_every}",
        f"--out={log}",
    ]
    # Restarted gloo workers hang in setup on torch 2.13 if they share the agent's store.
    env = launch.child_env(threads, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = launch.spawn(cmd, env, wd / "torchrun.log")
    deadline = time.time() + timeout_s
    try:

        def reached() -> dict[str, Any] | None:
            rows = launch.read_jsonl(log)
            if any(r["event"] == "step" and r["step"] >= kill_at_step for r in rows):
                starts = [r for r in rows if r["event"] == "start" and r["rank"] == nproc - 1]
                return starts[-1] if starts else None
            return None

        victim = launch.wait_for("torchrun kill_at_step", reached, deadline, [proc])
        os.kill(victim["pid"], signal.SIGKILL)
        t_kill = time.time()
        launch.wait_exit([proc], deadline, "ddp_ckpt_restart", wd / "torchrun.log")
    finally:
        launch.kill_tree(proc, grace_s=2.0)
        launch.kill_logged(log, "ddp_ckpt_restart.py")

    rows = launch.read_jsonl(log)
    steps_rows = [r for r in rows if r["event"] == "step"]
    restarts = [r for r in rows if r["event"] == "start" and r["wall"] > t_kill]
    steady = [r["step_ms"] for r in steps_rows if r["wall"] <= t_kill and not r["warmup"]]
    out = launch.recovery_figures(steps_rows, t_kill)
    if restarts:
        # Where the restart time goes: the agent notices, stops the survivors and
        # relaunches; torch import and process group; model/DDP setup (DDP's
        # constructor imports torch._dynamo: seconds) and checkpoint load.
        first = min(restarts, key=lambda r: r["launched_wall"])
        out["phases_s"] = {
            "relaunch": first["launched_wall"] - t_kill,
            "import_and_pg": max(r["pg_wall"] for r in restarts) - first["launched_wall"],
            "setup_and_load": max(r["wall"] for r in restarts)
            - max(r["pg_wall"] for r in restarts),
        }
    out.update(
        step_ms_median=launch.median_or_none(steady),
        restart_s=min(r["wall"] for r in restarts) - t_kill if restarts else None,
        resume_step=restarts[0]["resume_step"] if restarts else None,
        ckpt_every=ckpt_every,
        nproc=nproc,
        size=size,
        log=str(log),
    )
    return out


# ---------------------------------------------------------------- repeated faults
#
# The runs of ``bench/goodput.py``: a system trains for a window of ``duration_s``
# while an outside ``KillHarness`` (bench/kill_harness.py) SIGKILLs one of its
# active workers on a seeded schedule. These runners start the system, open the
# window once ``warmup`` steps are committed, tell the harness how to find the
# active workers, keep the system going (a scheduler's part: torchrun restarts
# its own workers; torchft's replacement is started here, at once), and return
# the raw records; bench/goodput.py turns them into figures, the same way for all.


def _torchrun_victims(tail: JsonlTail, agent_pid: int) -> list[Victim]:
    """The workers of torchrun's current round, once the round has committed a step (not
    the agent; not a round still starting up)."""
    rows = tail.read()
    starts = [r for r in rows if r.get("event") == "start"]
    if not starts:
        return []
    current = max(r["restart"] for r in starts)
    if not any(r.get("event") == "step" and r.get("restart") == current for r in rows):
        return []
    workers = set(launch.descendants(agent_pid))
    return [Victim(f"rank{r['rank']}", r["pid"]) for r in starts
            if r["restart"] == current and r["pid"] in workers]


def run_torchrun_faults(
    duration_s: float,
    harness: KillHarness,
    size: str = "medium",
    nproc: int = 3,
    *,
    threads: int = 1,
    ckpt_every: int = 10,
    max_restarts: int = 10_000,
    warmup: int = 3,
    start_timeout_s: float = 300.0,
    workdir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """DDP + a checkpoint every ``ckpt_every`` steps under ``torchrun --max-restarts``,
    trained for ``duration_s`` while ``harness`` kills its workers.

    The window opens when rank 0 has committed step ``warmup``. The harness's
    victims are the current round's worker processes (descendants of the agent
    named in the round's ``start`` records, once the round has committed a step).
    Every kill makes torchrun's agent stop the round and start all workers again,
    which resume from the checkpoint. Returns ``commits`` (``step``, ``wall``,
    ``width``, ``started``: rank 0's steps), the window (``t0``, ``t1``), the harness's
    ``kills`` and ``skipped_kills``, ``restarts`` (rounds started in the window),
    ``ckpt_save_ms`` (rank 0's save times) and the configuration.
    """
    wd = launch.workdir_path(workdir, "ddp_faults_")
    log = launch.fresh_log(wd / "ddp_restart.jsonl")
    cmd = [
        *_torchrun(nproc, max_restarts),
        str(launch.HERE / "ddp_ckpt_restart.py"),
        f"--steps={launch.ENDLESS}",
        f"--size={size}",
        f"--threads={threads}",
        f"--warmup={warmup}",
        f"--ckpt={wd / 'ckpt.pt'}",
        f"--ckpt-every={ckpt_every}",
        f"--out={log}",
    ]
    # Restarted gloo workers hang in setup on torch 2.13 if they share the agent's store.
    proc = launch.spawn(cmd, launch.child_env(threads, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                        wd / "torchrun.log")
    tail = JsonlTail(log)
    try:
        t0 = launch.wait_for("torchrun warm-up", lambda: launch.window_open(tail, warmup),
                       time.time() + start_timeout_s, [proc])
        harness.start(t0, victims=lambda: _torchrun_victims(tail, proc.pid),
                      step_s=lambda: step_period_s(launch.step_commits(tail.read())))
        while time.time() < t0 + duration_s:
            if proc.poll() is not None:
                raise RuntimeError(f"torchrun exited with {proc.returncode} during the window")
            time.sleep(0.1)
    finally:
        harness.stop()
        launch.kill_tree(proc, grace_s=2.0)
        launch.kill_logged(log, "ddp_ckpt_restart.py")
    rows = launch.read_jsonl(log)
    t1 = t0 + duration_s
    rounds = {r["restart"]: r["wall"] for r in rows if r["event"] == "start"}
    return {
        "commits": [launch.commit_record(r, nproc) for r in rows if r["event"] == "step"],
        "t0": t0,
        "t1": t1,
        "kills": harness.kills,
        "skipped_kills": harness.skipped,
        "restarts": sum(1 for n, wall in rounds.items() if n > 0 and t0 < wall <= t1),
        "ckpt_save_ms": [r["save_ms"] for r in rows if r["event"] == "ckpt"],
        "ckpt_every": ckpt_every,
        "replicas": nproc,
        "size": size,
        "log": str(log),
    }


