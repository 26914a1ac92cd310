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

``run_torchrun_faults`` and ``run_torchft_faults`` (for ``bench/goodput.py``)
instead train for a window while an outside harness kills workers again and
again, and return the raw records (committed steps, kills) from which that bench
computes the same figures per kill.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
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

from bench.baselines.torchft_config import TorchftConfig
from bench.baselines.torchft_standby import Standby
from bench.kill_harness import JsonlTail, KillHarness, Victim, step_period_s

__all__ = [
    "run_ddp_steady",
    "run_hsdp_steady",
    "run_torchft_faults",
    "run_torchft_kill",
    "run_torchft_steady",
    "run_torchrun_faults",
    "run_torchrun_kill",
    "torchft_commands",
    "torchft_version",
]

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


def _spawn(cmd: list[str], env: dict[str, str], log: Path, *, stdin: int = subprocess.DEVNULL
           ) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            env=env,
            cwd=str(_REPO),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=stdin,
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


def _wait_exit(
    procs: list[subprocess.Popen], deadline: float, what: str, log: Path | None = None
) -> None:
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired as err:
            raise TimeoutError(f"{what}: {p.args!r} still running at the deadline") from err
        if p.returncode != 0:
            raise RuntimeError(
                f"{what}: {p.args!r} exited with {p.returncode}{_log_tail(log)}"
            )


def _log_tail(log: Path | None, lines: int = 25) -> str:
    """The last ``lines`` of a process's log, for an error message ('' if there is none)."""
    if log is None or not log.exists():
        return ""
    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
    return f"; the last lines of {log}:\n" + "\n".join(tail)


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
    for launch in range(1, _LAUNCHES + 1):
        start = log.stat().st_size if log.exists() else 0
        proc = _spawn(cmd(), env, log)
        try:
            _wait_exit([proc], time.time() + timeout_s, what, log)
            return
        except RuntimeError:
            with open(log, "rb") as f:
                f.seek(start)
                printed = f.read().decode("utf-8", errors="replace").lower()
            if launch == _LAUNCHES or not any(m in printed for m in _PORT_TAKEN):
                raise
        finally:
            _kill_tree(proc, grace_s=2.0)
            _kill_logged(records, script)


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


def _start_torchft_group(
    script: list[str], log: Path, *, threads: int, group: int | None, groups: int, lh_port: int
) -> subprocess.Popen:
    """One torchft replica group: a process of world size 1 that finds its peers through the
    lighthouse on ``lh_port``; ``group=None``: a warm standby (``--standby``), told its group
    on stdin."""
    env = _env(
        threads,
        REPLICA_GROUP_ID="" if group is None else str(group),
        NUM_REPLICA_GROUPS=str(groups),
        TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{lh_port}",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),  # read by older scripts; torchft_train.py binds its own
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )
    if group is None:
        return _spawn([*script, "--standby"], env, log, stdin=subprocess.PIPE)
    return _spawn(script, env, log)


def _heartbeat_interval_ms(config: TorchftConfig) -> int:
    """The managers' heartbeat period: torchft's 100 ms, or a quarter of a shorter timeout
    (a heartbeat period near the timeout would drop live groups)."""
    return max(5, min(100, config.heartbeat_ms // 4))


def torchft_commands(
    config: TorchftConfig, lh_port: int, min_replicas: int, join_timeout_ms: int,
    script_args: list[str],
) -> tuple[list[str], list[str]]:
    """The lighthouse's and a group's command lines for ``config``."""
    if config.pg_timeout_s is None:
        raise ValueError("TorchftConfig.pg_timeout_s is None: the caller resolves it "
                         "(e.g. 10 x the fault-free step, at least 2 s) before a run")
    lighthouse = [
        _lighthouse_binary(),
        "--min_replicas", str(min_replicas),
        "--bind", f"127.0.0.1:{lh_port}",
        "--heartbeat_timeout_ms", str(config.heartbeat_ms),
        "--quorum_tick_ms", str(config.quorum_tick_ms),
        "--join_timeout_ms", str(join_timeout_ms),
    ]
    script = [
        sys.executable,
        str(_HERE / "torchft_train.py"),
        *script_args,
        f"--pg-timeout-s={config.pg_timeout_s}",
        f"--heartbeat-interval-ms={_heartbeat_interval_ms(config)}",
        *(["--async-quorum"] if config.async_quorum else []),
    ]
    return lighthouse, script


def _torchft_record(config: TorchftConfig) -> dict[str, Any]:
    """What every torchft result names: the configuration and the torchft that ran it."""
    return {"config": config.as_dict(), "torchft_version": torchft_version(),
            "heartbeat_interval_ms": _heartbeat_interval_ms(config)}


def torchft_version() -> str | None:
    """The version of the torchft this Python imports, named by its distribution
    (``torchft-nightly 2026.10.26`` where a nightly shadows the release); None where
    torchft is not installed."""
    spec = importlib.util.find_spec("torchft")
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin).resolve()
    for name in importlib.metadata.packages_distributions().get("torchft", []):
        dist = importlib.metadata.distribution(name)
        if Path(str(dist.locate_file("torchft/__init__.py"))).resolve() == origin:
            return dist.version if name == "torchft" else f"{name} {dist.version}"
    return None


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
    prefetch: str = "ahead",
) -> dict[str, Any]:
    """Plain DDP under torchrun for ``steps`` steps; rank 0's step times (``device``,
    ``backend`` and ``prefetch``: ``ddp_train.py``'s ``--device``, ``--backend`` and
    ``--prefetch``).

    Returns ``{"step_ms_median", "step_ms" (steady steps, warm-up left out),
    "nproc", "size", "log"}``.
    """
    if steps <= warmup:
        raise ValueError(f"steps={steps} must exceed warmup={warmup}")
    wd = _workdir(workdir, "ddp_steady_")
    log = wd / "ddp.jsonl"
    args = [
        str(_HERE / "ddp_train.py"),
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
        _env(threads, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
        wd / "torchrun.log", timeout_s, "ddp_train", "ddp_train.py", log,
    )
    rows = [r for r in _read_jsonl(log) if r["event"] == "step" and not r["warmup"]]
    step_ms = [r["step_ms"] for r in rows]
    return {
        "step_ms_median": _median(step_ms),
        "step_ms": step_ms,
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
    wd = _workdir(workdir, "hsdp_steady_")
    log = wd / "hsdp.jsonl"
    nproc = replicas * shards
    args = [
        str(_HERE / "hsdp_train.py"),
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
        _env(threads, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
        wd / "torchrun.log", timeout_s, "hsdp_train", "hsdp_train.py", log,
    )
    rows = [r for r in _read_jsonl(log) if r["event"] == "step"]
    step_ms = [r["step_ms"] for r in rows if not r["warmup"]]
    return {
        "step_ms_median": _median(step_ms),
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
        _wait_exit([proc], deadline, "ddp_ckpt_restart", wd / "torchrun.log")
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
    config: TorchftConfig,
    threads: int = 1,
    victim: int | None = None,
    restart_delay_s: float = 0.0,
    replacement_grace_s: float = 5.0,
    warmup: int = 3,
    compare_ddp: bool = False,
    timeout_s: float = 300.0,
    workdir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """torchft replica groups (one process each) + lighthouse; SIGKILL one group mid-run.

    torchft runs as ``config`` says (its ``pg_timeout_s`` resolved by the caller). Replica
    group ``victim`` (default: the last) SIGKILLs itself inside step ``kill_at_step``, a
    third of its median step in (``torchft_train.py --die-at-step``: where planaria's chaos
    plan lands a kill planned for a step, so both are killed at the same point of a step;
    the kill's time is the one it logs just before), and, after ``restart_delay_s``, the
    runner starts a replacement with the same group id (as a scheduler would) -- with
    ``config.warm_standby``, tells a standby started with the groups to join as it; it
    heals from a survivor and rejoins. The lighthouse runs with ``--min_replicas
    groups-1`` so the survivors go on without the victim.

    Figures (module docstring), computed over the *survivors'* committed
    steps: ``recover_s`` = kill → a survivor's next committed step,
    ``back_s`` = kill → a survivor's first commit of a step beyond ``s_max``
    (``== recover_s`` when no committed step is lost), ``lost_steps``. Also:
    ``failed_steps`` (survivor iterations that did not commit after the kill),
    ``rejoin_s`` (replacement started or told → its first committed step; None if the
    survivors finished before it joined: then it is killed after
    ``replacement_grace_s``),
    ``min_participants``, ``config`` / ``torchft_version``, and with ``compare_ddp`` a
    plain DDP run of the same width: ``ddp_step_ms_median`` and ``steady_overhead_vs_ddp``
    (torchft's steady median ÷ DDP's, minus 1).
    """
    if not warmup < kill_at_step < steps - 1:
        raise ValueError("need warmup < kill_at_step < steps - 1")
    if groups < 2:
        raise ValueError("groups must be >= 2 (survivors are needed)")
    victim = groups - 1 if victim is None else victim
    wd = _workdir(workdir, "torchft_kill_")
    log = wd / "torchft.jsonl"
    lh_port = _free_port()
    lighthouse, script = torchft_commands(
        config, lh_port, max(1, groups - 1), 60_000,
        [f"--steps={steps}", f"--size={size}", f"--threads={threads}", f"--warmup={warmup}",
         f"--out={log}"])

    def start_group(g: int | None, tag: str, die_at: int | None = None) -> subprocess.Popen:
        name = "standby" if g is None else f"group{g}"
        cmd = script if die_at is None else [*script, f"--die-at-step={die_at}"]
        return _start_torchft_group(cmd, wd / f"{name}{tag}.log", threads=threads,
                                    group=g, groups=groups, lh_port=lh_port)

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
    standby = None
    try:
        procs.append(_spawn(lighthouse, _env(threads), wd / "lighthouse.log"))
        time.sleep(0.2)
        groups_p = [start_group(g, "", die_at=kill_at_step if g == victim else None)
                    for g in range(groups)]
        procs += groups_p
        if config.warm_standby:
            standby = Standby(lambda n: _track(procs, start_group(None, str(n))))

        def killed() -> list[dict[str, Any]]:
            return [r for r in _read_jsonl(log) if r["event"] == "kill"]

        # The victim kills itself inside step kill_at_step (torchft_train.py --die-at-step).
        _wait_for("torchft kill_at_step", lambda: bool(killed()), deadline, procs)
        t_kill = float(killed()[0]["wall"])
        groups_p[victim].wait(timeout=10)
        time.sleep(restart_delay_s)
        t_restart = time.time()
        if standby is not None:
            replacement = standby.take(victim)
        else:
            replacement = start_group(victim, ".replacement")
            procs.append(replacement)
        _wait_exit([p for i, p in enumerate(groups_p) if i != victim], deadline, "torchft_train")
        # A replacement that joined finishes with the survivors; one still starting up
        # when they finished waits for a quorum that never comes: give it a moment.
        with contextlib.suppress(subprocess.TimeoutExpired):
            replacement.wait(timeout=replacement_grace_s)
    finally:
        if standby is not None:
            standby.close()
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
        **_torchft_record(config),
    )
    if ddp is not None:
        out["ddp_step_ms_median"] = ddp["step_ms_median"]
        if out["step_ms_median"] and ddp["step_ms_median"]:
            out["steady_overhead_vs_ddp"] = out["step_ms_median"] / ddp["step_ms_median"] - 1
    return out


def _track(procs: list[subprocess.Popen], proc: subprocess.Popen) -> subprocess.Popen:
    """Adds ``proc`` to the processes a runner kills at its end; returns it."""
    procs.append(proc)
    return proc


def run_torchft_steady(
    steps: int,
    size: str = "medium",
    groups: int = 3,
    *,
    config: TorchftConfig,
    threads: int = 1,
    warmup: int = 3,
    grads: str = "bucket",
    prefetch: str = "ahead",
    script: str = "torchft_train.py",
    save_grads: bool = False,
    timeout_s: float = 300.0,
    workdir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """torchft replica groups + lighthouse for ``steps`` fault-free steps (``grads`` and
    ``prefetch``: ``torchft_train.py``'s options; ``script``: the training script in this
    folder). Returns ``{"step_ms_median"`` (group 0's steady steps), ``"step_ms"``,
    ``"phases_ms_median"`` (per phase, group 0), ``"config"``, ``"torchft_version"``,
    ``"log"}``; with ``save_grads``, ``"grads"``: per group, the path of its committed
    steps' reduced gradients (``torch.save`` of a list of flat tensors)."""
    if steps <= warmup:
        raise ValueError(f"steps={steps} must exceed warmup={warmup}")
    wd = _workdir(workdir, "torchft_steady_")
    log = wd / "torchft.jsonl"
    lh_port = _free_port()
    lighthouse, cmd = torchft_commands(
        config, lh_port, groups, 60_000,
        [f"--steps={steps}", f"--size={size}", f"--threads={threads}", f"--warmup={warmup}",
         f"--out={log}", f"--grads={grads}", f"--prefetch={prefetch}",
         *([f"--grads-out={wd}/grads{{group}}.pt"] if save_grads else [])])
    cmd[1] = str(_HERE / script)
    if script != "torchft_train.py":  # an older script: only the options it knows
        cmd = [c for c in cmd if not c.startswith(("--grads", "--prefetch", "--heartbeat-int"))]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_spawn(lighthouse, _env(threads), wd / "lighthouse.log"))
        time.sleep(0.2)
        workers = [_start_torchft_group(cmd, wd / f"group{g}.log", threads=threads, group=g,
                                        groups=groups, lh_port=lh_port) for g in range(groups)]
        procs += workers
        _wait_exit(workers, time.time() + timeout_s, "torchft_train", wd / "group0.log")
    finally:
        for p in reversed(procs):
            _kill_tree(p)
        _kill_logged(log, script)
    rows = [r for r in _read_jsonl(log) if r["event"] == "step" and r["group"] == 0
            and r["committed"] and not r["warmup"]]
    phases = {k: _median([r["phases_ms"][k] for r in rows]) for k in
              (rows[0].get("phases_ms") or {} if rows else {})}
    return {"step_ms_median": _median([r["step_ms"] for r in rows]),
            "step_ms": [r["step_ms"] for r in rows], "phases_ms_median": phases,
            "groups": groups, "size": size, "log": str(log), **_torchft_record(config),
            **({"grads": [str(wd / f"grads{g}.pt") for g in range(groups)]} if save_grads else {})}


# ---------------------------------------------------------------- repeated faults
#
# The runs of ``bench/goodput.py``: a system trains for a window of ``duration_s``
# while an outside ``KillHarness`` (bench/kill_harness.py) SIGKILLs one of its
# active workers on a seeded schedule. These runners start the system, open the
# window once ``warmup`` steps are committed, tell the harness how to find the
# active workers, keep the system going (a scheduler's part: torchrun restarts
# its own workers; torchft's replacement is started here, at once), and return
# the raw records; bench/goodput.py turns them into figures, the same way for all.

_ENDLESS = 10**9  # steps: the window's end stops a run, not a step count


def _window_open(tail: JsonlTail, warmup: int) -> float | None:
    """``time.time()`` once a committed step ``>= warmup`` is in the log."""
    done = any(
        r.get("event") == "step" and r.get("committed", True) and r["step"] >= warmup
        for r in tail.read()
    )
    return time.time() if done else None


def _step_commits(rows: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(r["step"], r["wall"]) for r in rows
            if r.get("event") == "step" and r.get("committed", True)]


def _commit(row: dict[str, Any], width: int) -> dict[str, Any]:
    """A logged step as a commit record: ``started`` is when the step began."""
    return {"step": row["step"], "wall": row["wall"], "width": width,
            "started": row["wall"] - row["step_ms"] / 1000}


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
    workers = set(_descendants(agent_pid))
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
    wd = _workdir(workdir, "ddp_faults_")
    log = wd / "ddp_restart.jsonl"
    cmd = [
        *_torchrun(nproc, max_restarts),
        str(_HERE / "ddp_ckpt_restart.py"),
        f"--steps={_ENDLESS}",
        f"--size={size}",
        f"--threads={threads}",
        f"--warmup={warmup}",
        f"--ckpt={wd / 'ckpt.pt'}",
        f"--ckpt-every={ckpt_every}",
        f"--out={log}",
    ]
    # Restarted gloo workers hang in setup on torch 2.13 if they share the agent's store.
    proc = _spawn(cmd, _env(threads, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), wd / "torchrun.log")
    tail = JsonlTail(log)
    try:
        t0 = _wait_for("torchrun warm-up", lambda: _window_open(tail, warmup),
                       time.time() + start_timeout_s, [proc])
        harness.start(t0, victims=lambda: _torchrun_victims(tail, proc.pid),
                      step_s=lambda: step_period_s(_step_commits(tail.read())))
        while time.time() < t0 + duration_s:
            if proc.poll() is not None:
                raise RuntimeError(f"torchrun exited with {proc.returncode} during the window")
            time.sleep(0.1)
    finally:
        harness.stop()
        _kill_tree(proc, grace_s=2.0)
        _kill_logged(log, "ddp_ckpt_restart.py")
    rows = _read_jsonl(log)
    t1 = t0 + duration_s
    rounds = {r["restart"]: r["wall"] for r in rows if r["event"] == "start"}
    return {
        "commits": [_commit(r, nproc) for r in rows if r["event"] == "step"],
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


def _torchft_victims(tail: JsonlTail, current: dict[int, subprocess.Popen]) -> list[Victim]:
    """Groups whose current process has committed a step (a replacement still starting
    up or healing before its first commit is not yet training)."""
    rows = tail.read()
    started = {r["pid"]: r["wall"] for r in rows if r.get("event") == "start"}
    trained: dict[int, float] = {}
    for r in rows:
        if r.get("event") == "step" and r["committed"]:
            trained[r["group"]] = r["wall"]  # the group's latest commit
    return [
        Victim(f"group{g}", p.pid) for g, p in sorted(current.items())
        if p.poll() is None and p.pid in started and trained.get(g, 0.0) > started[p.pid]
    ]


def _first_commits(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One commit per step: the earliest group's (they commit a step together)."""
    first: dict[int, dict[str, Any]] = {}
    for r in sorted((r for r in rows if r["event"] == "step" and r["committed"]),
                    key=lambda r: r["wall"]):
        first.setdefault(r["step"], _commit(r, r["participants"]))
    return sorted(first.values(), key=lambda c: c["wall"])


def run_torchft_faults(
    duration_s: float,
    harness: KillHarness,
    size: str = "medium",
    groups: int = 3,
    *,
    config: TorchftConfig,
    threads: int = 1,
    min_replicas: int = 1,
    join_timeout_ms: int = 10_000,
    warmup: int = 3,
    start_timeout_s: float = 300.0,
    workdir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """torchft replica groups (one process each) + a lighthouse, trained for ``duration_s``
    while ``harness`` kills group processes; a killed group's replacement (same group id)
    is started at once -- with ``config.warm_standby``, a standby process started ahead
    is told to join as it, and the next standby is started.

    torchft runs as ``config`` says (its ``pg_timeout_s`` resolved by the caller): the
    lighthouse with ``--min_replicas min_replicas`` (survivors go on),
    ``--heartbeat_timeout_ms`` (how soon a dead group leaves the quorum),
    ``--quorum_tick_ms`` and ``--join_timeout_ms`` (how long a quorum waits for a
    group that heartbeats but has not asked to join); the groups with the gloo
    timeout and, with ``async_quorum``, torchft's asynchronous quorum. The window
    opens when a group has committed step ``warmup``; the harness's victims are the
    groups whose current process has committed a step. Returns ``commits`` (one
    per step: the earliest group's, ``width`` = its participants), the window,
    ``kills``, ``skipped_kills``, ``replacements`` (``group``, ``exit_code`` of the
    process it replaces, ``started_t``: started or told, ``standby``, ``rejoin_s``:
    started → its first committed step), ``failed_iterations`` (iterations in the
    window that did not commit, over all groups), ``config`` and ``torchft_version``.
    """
    wd = _workdir(workdir, "torchft_faults_")
    log = wd / "torchft.jsonl"
    lh_port = _free_port()
    lighthouse, script = torchft_commands(
        config, lh_port, min_replicas, join_timeout_ms,
        [f"--steps={_ENDLESS}", f"--size={size}", f"--threads={threads}",
         f"--warmup={warmup}", f"--out={log}"])

    def start_group(g: int | None, tag: str, die_at: int | None = None) -> subprocess.Popen:
        name = "standby" if g is None else f"group{g}"
        cmd = script if die_at is None else [*script, f"--die-at-step={die_at}"]
        return _start_torchft_group(cmd, wd / f"{name}{tag}.log", threads=threads,
                                    group=g, groups=groups, lh_port=lh_port)

    tail = JsonlTail(log)
    procs: list[subprocess.Popen] = []
    replacements: list[dict[str, Any]] = []
    standby = None
    try:
        procs.append(_spawn(lighthouse, _env(threads), wd / "lighthouse.log"))
        time.sleep(0.2)
        current = {g: start_group(g, "") for g in range(groups)}
        procs += current.values()
        if config.warm_standby:
            standby = Standby(lambda n: _track(procs, start_group(None, str(n))))
        t0 = _wait_for("torchft warm-up", lambda: _window_open(tail, warmup),
                       time.time() + start_timeout_s, procs)
        harness.start(t0, victims=lambda: _torchft_victims(tail, current),
                      step_s=lambda: step_period_s(
                          [(c["step"], c["wall"]) for c in _first_commits(tail.read())]))
        while time.time() < t0 + duration_s:
            if procs[0].poll() is not None:
                raise RuntimeError(f"the lighthouse exited with {procs[0].returncode}")
            for g, p in list(current.items()):
                if p.poll() is not None:  # as a scheduler would: a new process at once
                    if standby is not None:
                        current[g] = standby.take(g)
                    else:
                        current[g] = start_group(g, f".r{len(replacements)}")
                        procs.append(current[g])
                    replacements.append({"group": g, "exit_code": p.returncode,
                                         "started_t": time.time(),
                                         "standby": standby is not None})
            time.sleep(_POLL_S)
    finally:
        harness.stop()
        if standby is not None:
            standby.close()
        for p in reversed(procs):
            _kill_tree(p)
        _kill_logged(log, "torchft_train.py")
    rows = _read_jsonl(log)
    t1 = t0 + duration_s
    for rep in replacements:
        back = [r["wall"] for r in rows if r["event"] == "step" and r["committed"]
                and r["group"] == rep["group"] and r["wall"] > rep["started_t"]]
        rep["rejoin_s"] = min(back) - rep["started_t"] if back else None
    return {
        "commits": _first_commits(rows),
        "t0": t0,
        "t1": t1,
        "kills": harness.kills,
        "skipped_kills": harness.skipped,
        "replacements": replacements,
        "failed_iterations": sum(1 for r in rows if r["event"] == "step"
                                 and not r["committed"] and t0 < r["wall"] <= t1),
        "heartbeat_timeout_ms": config.heartbeat_ms,
        "pg_timeout_s": config.pg_timeout_s,
        "async_quorum": config.async_quorum,
        "min_replicas": min_replicas,
        "join_timeout_ms": join_timeout_ms,
        "replicas": groups,
        "size": size,
        "log": str(log),
        **_torchft_record(config),
    }
