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
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_ddp_steady", "run_torchft_kill", "run_torchrun_kill"]

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parents[1]
_POLL_S = 0.01


# ---------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(threads: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(_REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    env.update(extra)
    return env


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            env=env,
            cwd=str(_REPO),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (Linux ``/proc``); empty elsewhere."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(proc: subprocess.Popen, grace_s: float = 0.0) -> None:
    """SIGKILLs ``proc``, its process group and every descendant, then reaps it."""
    if proc.poll() is None and grace_s > 0:
        # SIGTERM first: torchrun's agent then stops its own workers.
        _signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    pids = [*_descendants(proc.pid), proc.pid] if proc.poll() is None else []
    for pid in pids:
        _signal_group(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _signal_group(pid: int, sig: int) -> None:
    for fn in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            fn(pid, sig)


def _kill_logged(log: Path, script: str) -> None:
    """SIGKILLs workers named in ``start`` records that still run ``script`` (orphans)."""
    for r in _read_jsonl(log):
        if r.get("event") != "start" or "pid" not in r:
            continue
        try:
            cmdline = Path(f"/proc/{r['pid']}/cmdline").read_bytes()
        except OSError:
            continue  # gone (or not Linux)
        if script.encode() in cmdline:
            _signal_group(r["pid"], signal.SIGKILL)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn line being written
    return out


def _wait_for(
    what: str, predicate: Callable[[], Any], deadline: float, procs: list[subprocess.Popen]
) -> Any:
    """Polls ``predicate`` until it returns something truthy; raises on deadline or early exit."""
    while True:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                raise RuntimeError(f"{what}: process {p.args!r} exited with {p.returncode}")
        if time.time() > deadline:
            raise TimeoutError(f"{what}: not reached before the deadline")
        time.sleep(_POLL_S)


def _wait_exit(procs: list[subprocess.Popen], deadline: float, what: str) -> None:
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired as err:
            raise TimeoutError(f"{what}: {p.args!r} still running at the deadline") from err
        if p.returncode != 0:
            raise RuntimeError(f"{what}: {p.args!r} exited with {p.returncode}")


def _workdir(workdir: str | os.PathLike | None, prefix: str) -> Path:
    if workdir is not None:
        path = Path(workdir)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return Path(tempfile.mkdtemp(prefix=prefix))


def _torchrun(nproc: int, max_restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        f"--rdzv-id=bench{os.getpid()}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
    ]


def _lighthouse_binary() -> str:
    """The ``torchft_lighthouse`` entry point that ships in the torchft wheel."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(beside) if beside.exists() else shutil.which("torchft_lighthouse")
    if not found:
        raise FileNotFoundError("torchft_lighthouse not found: pip install torchft==0.2.0")
    return found


# ---------------------------------------------------------------- figures


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _recovery(steps: list[dict[str, Any]], t_kill: float) -> dict[str, Any]:
    """recover_s, back_s, lost_steps from committed-step records ``{step, wall}``."""
    before = [r for r in steps if r["wall"] <= t_kill]
    after = sorted((r for r in steps if r["wall"] > t_kill), key=lambda r: r["wall"])
    s_max = max((r["step"] for r in before), default=-1)
    beyond = [r for r in after if r["step"] > s_max]
    return {
        "s_max": s_max,
        "recover_s": after[0]["wall"] - t_kill if after else None,
        "back_s": beyond[0]["wall"] - t_kill if beyond else None,
        "lost_steps": len({r["step"] for r in after if r["step"] <= s_max}),
        "first_step_after": after[0]["step"] if after else None,
    }


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
) -> dict[str, Any]:
    """Plain DDP under torchrun for ``steps`` steps; rank 0's step times (``device`` and
    ``backend``: ``ddp_train.py``'s ``--device`` and ``--backend``).

    Returns ``{"step_ms_median", "step_ms" (steady steps, warm-up left out),
    "nproc", "size", "log"}``.
    """
    if steps <= warmup:
        raise ValueError(f"steps={steps} must exceed warmup={warmup}")
    wd = _workdir(workdir, "ddp_steady_")
    log = wd / "ddp.jsonl"
    cmd = [
        *_torchrun(nproc),
        str(_HERE / "ddp_train.py"),
        f"--steps={steps}",
        f"--size={size}",
        f"--threads={threads}",
        f"--warmup={warmup}",
        f"--out={log}",
        f"--device={device}",
        f"--backend={backend}",
    ]
    proc = _spawn(cmd, _env(threads, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), wd / "torchrun.log")
    try:
        _wait_exit([proc], time.time() + timeout_s, "ddp_train")
    finally:
        _kill_tree(proc, grace_s=2.0)
        _kill_logged(log, "ddp_train.py")
    rows = [r for r in _read_jsonl(log) if r["event"] == "step" and not r["warmup"]]
    step_ms = [r["step_ms"] for r in rows]
    return {
        "step_ms_median": _median(step_ms),
        "step_ms": step_ms,
        "nproc": nproc,
        "size": size,
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
    wd = _workdir(workdir, "ddp_restart_")
    log = wd / "ddp_restart.jsonl"
    cmd = [
        *_torchrun(nproc, max_restarts),
        str(_HERE / "ddp_ckpt_restart.py"),
        f"--steps={steps}",
        f"--size={size}",
        f"--threads={threads}",
        f"--warmup={warmup}",
        f"--ckpt={wd / 'ckpt.pt'}",
        f"--ckpt-every={ckpt_every}",
        f"--out={log}",
    ]
    # Restarted gloo workers hang in setup on torch 2.13 if they share the agent's store.
    env = _env(threads, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = _spawn(cmd, env, wd / "torchrun.log")
    deadline = time.time() + timeout_s
    try:

        def reached() -> dict[str, Any] | None:
            rows = _read_jsonl(log)
            if any(r["event"] == "step" and r["step"] >= kill_at_step for r in rows):
                starts = [r for r in rows if r["event"] == "start" and r["rank"] == nproc - 1]
                return starts[-1] if starts else None
            return None

        victim = _wait_for("torchrun kill_at_step", reached, deadline, [proc])
        os.kill(victim["pid"], signal.SIGKILL)
        t_kill = time.time()
        _wait_exit([proc], deadline, "ddp_ckpt_restart")
    finally:
        _kill_tree(proc, grace_s=2.0)
        _kill_logged(log, "ddp_ckpt_restart.py")

    rows = _read_jsonl(log)
    steps_rows = [r for r in rows if r["event"] == "step"]
    restarts = [r for r in rows if r["event"] == "start" and r["wall"] > t_kill]
    steady = [r["step_ms"] for r in steps_rows if r["wall"] <= t_kill and not r["warmup"]]
    out = _recovery(steps_rows, t_kill)
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
        step_ms_median=_median(steady),
        restart_s=min(r["wall"] for r in restarts) - t_kill if restarts else None,
        resume_step=restarts[0]["resume_step"] if restarts else None,
        ckpt_every=ckpt_every,
        nproc=nproc,
        size=size,
        log=str(log),
    )
    return out


def run_torchft_kill(
    steps: int,
    kill_at_step: int,
    size: str = "small",
    groups: int = 3,
    *,
    threads: int = 1,
    victim: int | None = None,
    restart_delay_s: float = 0.0,
    heartbeat_timeout_ms: int = 1000,
    replacement_grace_s: float = 5.0,
    warmup: int = 3,
    compare_ddp: bool = False,
    timeout_s: float = 300.0,
    workdir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """torchft replica groups (one process each) + lighthouse; SIGKILL one group mid-run.

    When any group logs a committed step ``>= kill_at_step``, the runner
    SIGKILLs replica group ``victim`` (default: the last) and, after
    ``restart_delay_s``, starts a replacement with the same group id (as a
    scheduler would); it heals from a survivor and rejoins. The lighthouse
    runs with ``--min_replicas groups-1`` so the survivors go on without the
    victim.

    Figures (module docstring), computed over the *survivors'* committed
    steps: ``recover_s`` = kill → a survivor's next committed step,
    ``back_s`` = kill → a survivor's first commit of a step beyond ``s_max``
    (``== recover_s`` when no committed step is lost), ``lost_steps``. Also:
    ``failed_steps`` (survivor iterations that did not commit after the kill),
    ``rejoin_s`` (replacement started → its first committed step; None if the
    survivors finished before it joined: then it is killed after
    ``replacement_grace_s``),
    ``min_participants``, and with ``compare_ddp`` a plain DDP run of the same
    width: ``ddp_step_ms_median`` and ``steady_overhead_vs_ddp`` (torchft's
    steady median ÷ DDP's, minus 1).
    """
    if not warmup < kill_at_step < steps - 1:
        raise ValueError("need warmup < kill_at_step < steps - 1")
    if groups < 2:
        raise ValueError("groups must be >= 2 (survivors are needed)")
    victim = groups - 1 if victim is None else victim
    wd = _workdir(workdir, "torchft_kill_")
    log = wd / "torchft.jsonl"
    lh_port = _free_port()
    lighthouse = [
        _lighthouse_binary(),
        "--min_replicas",
        str(max(1, groups - 1)),
        "--bind",
        f"127.0.0.1:{lh_port}",
        "--heartbeat_timeout_ms",
        str(heartbeat_timeout_ms),
        "--join_timeout_ms",
        "60000",
    ]
    script = [
        sys.executable,
        str(_HERE / "torchft_train.py"),
        f"--steps={steps}",
        f"--size={size}",
        f"--threads={threads}",
        f"--warmup={warmup}",
        f"--out={log}",
    ]

    def start_group(g: int, tag: str) -> subprocess.Popen:
        env = _env(
            threads,
            REPLICA_GROUP_ID=str(g),
            NUM_REPLICA_GROUPS=str(groups),
            TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{lh_port}",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
        )
        return _spawn(script, env, wd / f"group{g}{tag}.log")

    ddp = None
    if compare_ddp:
        ddp = run_ddp_steady(
            steps=max(warmup + 10, kill_at_step),
            size=size,
            nproc=groups,
            threads=threads,
            warmup=warmup,
            timeout_s=timeout_s,
            workdir=wd / "ddp",
        )
    deadline = time.time() + timeout_s
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_spawn(lighthouse, _env(threads), wd / "lighthouse.log"))
        time.sleep(0.2)
        groups_p = [start_group(g, "") for g in range(groups)]
        procs += groups_p

        def reached() -> bool:
            return any(
                r["event"] == "step" and r["committed"] and r["step"] >= kill_at_step
                for r in _read_jsonl(log)
            )

        _wait_for("torchft kill_at_step", reached, deadline, procs)
        groups_p[victim].kill()
        t_kill = time.time()
        groups_p[victim].wait(timeout=10)
        time.sleep(restart_delay_s)
        t_restart = time.time()
        replacement = start_group(victim, ".replacement")
        procs.append(replacement)
        _wait_exit([p for i, p in enumerate(groups_p) if i != victim], deadline, "torchft_train")
        # A replacement that joined finishes with the survivors; one still starting up
        # when they finished waits for a quorum that never comes: give it a moment.
        with contextlib.suppress(subprocess.TimeoutExpired):
            replacement.wait(timeout=replacement_grace_s)
    finally:
        for p in reversed(procs):
            _kill_tree(p)
        _kill_logged(log, "torchft_train.py")

    rows = [r for r in _read_jsonl(log) if r["event"] == "step"]
    survivors = [r for r in rows if r["group"] != victim]
    committed = [r for r in survivors if r["committed"]]
    steady = [r["step_ms"] for r in committed if r["wall"] <= t_kill and not r["warmup"]]
    rejoined = [
        r for r in rows if r["group"] == victim and r["committed"] and r["wall"] > t_restart
    ]
    out = _recovery(committed, t_kill)
    out.update(
        step_ms_median=_median(steady),
        failed_steps=sum(1 for r in survivors if r["wall"] > t_kill and not r["committed"]),
        rejoin_s=min(r["wall"] for r in rejoined) - t_restart if rejoined else None,
        min_participants=min(
            (r["participants"] for r in survivors if r["wall"] > t_kill), default=None
        ),
        groups=groups,
        size=size,
        log=str(log),
    )
    if ddp is not None:
        out["ddp_step_ms_median"] = ddp["step_ms_median"]
        if out["step_ms_median"] and ddp["step_ms_median"]:
            out["steady_overhead_vs_ddp"] = out["step_ms_median"] / ddp["step_ms_median"] - 1
    return out
