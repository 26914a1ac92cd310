"""torchft's runners: replica groups (one process each, ``torchft_train.py``) and a
lighthouse, launched on 127.0.0.1 for one kill (``run_torchft_kill``), fault-free
(``run_torchft_steady``) or under a kill harness (``run_torchft_faults``), each as its
``TorchftConfig`` says and naming it (with the torchft that ran) in its result. The
figures' definitions are ``bench/baselines/runners.py``'s."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.baselines import launch
from bench.baselines.runners import run_ddp_steady
from bench.baselines.torchft_config import TorchftConfig
from bench.baselines.torchft_standby import Standby
from bench.kill_harness import JsonlTail, KillHarness, Victim, step_period_s

__all__ = ["run_torchft_faults", "run_torchft_kill", "run_torchft_steady", "torchft_commands",
           "torchft_version"]


def _lighthouse_binary() -> str:
    """The ``torchft_lighthouse`` entry point that ships in the torchft wheel."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(beside) if beside.exists() else shutil.which("torchft_lighthouse")
    if not found:
        raise FileNotFoundError("torchft_lighthouse not found: pip install torchft==0.2.0")
    return found


def _start_torchft_group(
    script: list[str], log: Path, *, threads: int, group: int | None, groups: int, lh_port: int
) -> subprocess.Popen:
    """One torchft replica group: a process of world size 1 that finds its peers through the
    lighthouse on ``lh_port``; ``group=None``: a warm standby (``--standby``), told its group
    on stdin."""
    env = launch.child_env(
        threads,
        REPLICA_GROUP_ID="" if group is None else str(group),
        NUM_REPLICA_GROUPS=str(groups),
        TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{lh_port}",
        MASTER_ADDR="127.0.0.1",
        # read by older scripts; torchft_train.py binds its own
        MASTER_PORT=str(launch.free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )
    if group is None:
        return launch.spawn([*script, "--standby"], env, log, stdin=subprocess.PIPE)
    return launch.spawn(script, env, log)


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
        str(launch.HERE / "torchft_train.py"),
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
    wd = launch.workdir_path(workdir, "torchft_kill_")
    log = launch.fresh_log(wd / "torchft.jsonl")
    lh_port = launch.free_port()
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
        procs.append(launch.spawn(lighthouse, launch.child_env(threads), wd / "lighthouse.log"))
        time.sleep(0.2)
        groups_p = [start_group(g, "", die_at=kill_at_step if g == victim else None)
                    for g in range(groups)]
        procs += groups_p
        if config.warm_standby:
            standby = Standby(lambda n: _track(procs, start_group(None, str(n))))

        def killed() -> list[dict[str, Any]]:
            return [r for r in launch.read_jsonl(log) if r["event"] == "kill"]

        # The victim kills itself inside step kill_at_step (torchft_train.py --die-at-step).
        launch.wait_for("torchft kill_at_step", lambda: bool(killed()), deadline, procs)
        t_kill = float(killed()[0]["wall"])
        groups_p[victim].wait(timeout=10)
        time.sleep(restart_delay_s)
        t_restart = time.time()
        if standby is not None:
            replacement = standby.take(victim)
        else:
            replacement = start_group(victim, ".replacement")
            procs.append(replacement)
        launch.wait_exit([p for i, p in enumerate(groups_p) if i != victim], deadline,
                         "torchft_train")
        # A replacement that joined finishes with the survivors; one still starting up
        # when they finished waits for a quorum that never comes: give it a moment.
        with contextlib.suppress(subprocess.TimeoutExpired):
            replacement.wait(timeout=replacement_grace_s)
    finally:
        if standby is not None:
            standby.close()
        for p in reversed(procs):
            launch.kill_tree(p)
        launch.kill_logged(log, "torchft_train.py")

    rows = [r for r in launch.read_jsonl(log) if r["event"] == "step"]
    survivors = [r for r in rows if r["group"] != victim]
    committed = [r for r in survivors if r["committed"]]
    steady = [r["step_ms"] for r in committed if r["wall"] <= t_kill and not r["warmup"]]
    rejoined = [
        r for r in rows if r["group"] == victim and r["committed"] and r["wall"] > t_restart
    ]
    out = launch.recovery_figures(committed, t_kill)
    out.update(
        step_ms_median=launch.median_or_none(steady),
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
    wd = launch.workdir_path(workdir, "torchft_steady_")
    log = launch.fresh_log(wd / "torchft.jsonl")
    lh_port = launch.free_port()
    lighthouse, cmd = torchft_commands(
        config, lh_port, groups, 60_000,
        [f"--steps={steps}", f"--size={size}", f"--threads={threads}", f"--warmup={warmup}",
         f"--out={log}", f"--grads={grads}", f"--prefetch={prefetch}",
         *([f"--grads-out={wd}/grads{{group}}.pt"] if save_grads else [])])
    cmd[1] = str(launch.HERE / script)
    if script != "torchft_train.py":  # an older script: only the options it knows
        cmd = [c for c in cmd if not c.startswith(("--grads", "--prefetch", "--heartbeat-int"))]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(launch.spawn(lighthouse, launch.child_env(threads), wd / "lighthouse.log"))
        time.sleep(0.2)
        workers = [_start_torchft_group(cmd, wd / f"group{g}.log", threads=threads, group=g,
                                        groups=groups, lh_port=lh_port) for g in range(groups)]
        procs += workers
        launch.wait_exit(workers, time.time() + timeout_s, "torchft_train", wd / "group0.log")
    finally:
        for p in reversed(procs):
            launch.kill_tree(p)
        launch.kill_logged(log, script)
    rows = [r for r in launch.read_jsonl(log) if r["event"] == "step" and r["group"] == 0
            and r["committed"] and not r["warmup"]]
    phases = {k: launch.median_or_none([r["phases_ms"][k] for r in rows]) for k in
              (rows[0].get("phases_ms") or {} if rows else {})}
    return {"step_ms_median": launch.median_or_none([r["step_ms"] for r in rows]),
            "step_ms": [r["step_ms"] for r in rows], "phases_ms_median": phases,
            "groups": groups, "size": size, "log": str(log), **_torchft_record(config),
            **({"grads": [str(wd / f"grads{g}.pt") for g in range(groups)]} if save_grads else {})}


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
        first.setdefault(r["step"], launch.commit_record(r, r["participants"]))
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
    wd = launch.workdir_path(workdir, "torchft_faults_")
    log = launch.fresh_log(wd / "torchft.jsonl")
    lh_port = launch.free_port()
    lighthouse, script = torchft_commands(
        config, lh_port, min_replicas, join_timeout_ms,
        [f"--steps={launch.ENDLESS}", f"--size={size}", f"--threads={threads}",
         f"--warmup={warmup}", f"--out={log}"])

    def start_group(g: int | None, tag: str) -> subprocess.Popen:
        name = "standby" if g is None else f"group{g}"
        return _start_torchft_group(script, wd / f"{name}{tag}.log", threads=threads,
                                    group=g, groups=groups, lh_port=lh_port)

    tail = JsonlTail(log)
    procs: list[subprocess.Popen] = []
    replacements: list[dict[str, Any]] = []
    standby = None
    try:
        procs.append(launch.spawn(lighthouse, launch.child_env(threads), wd / "lighthouse.log"))
        time.sleep(0.2)
        current = {g: start_group(g, "") for g in range(groups)}
        procs += current.values()
        if config.warm_standby:
            standby = Standby(lambda n: _track(procs, start_group(None, str(n))))
        t0 = launch.wait_for("torchft warm-up", lambda: launch.window_open(tail, warmup),
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
            time.sleep(launch.POLL_S)
    finally:
        harness.stop()
        if standby is not None:
            standby.close()
        for p in reversed(procs):
            launch.kill_tree(p)
        launch.kill_logged(log, "torchft_train.py")
    rows = launch.read_jsonl(log)
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
