"""What the baseline runners share: child processes started in sessions of their own and
killed with every descendant, bounded waits, JSON-lines logs, and the recovery figures'
one definition (``recovery_figures``; see ``bench/baselines/runners.py``'s docstring)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.kill_harness import JsonlTail

__all__ = [
    "ENDLESS",
    "HERE",
    "POLL_S",
    "REPO",
    "child_env",
    "commit_record",
    "descendants",
    "free_port",
    "fresh_log",
    "kill_logged",
    "kill_tree",
    "log_tail",
    "median_or_none",
    "read_jsonl",
    "recovery_figures",
    "signal_group",
    "spawn",
    "step_commits",
    "wait_exit",
    "wait_for",
    "window_open",
    "workdir_path",
]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
POLL_S = 0.01


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(threads: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    env.update(extra)
    return env


def spawn(cmd: list[str], env: dict[str, str], log: Path, *, stdin: int = subprocess.DEVNULL
           ) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            env=env,
            cwd=str(REPO),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=stdin,
            start_new_session=True,
        )


def descendants(pid: int) -> list[int]:
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


def kill_tree(proc: subprocess.Popen, grace_s: float = 0.0) -> None:
    """SIGKILLs ``proc``, its process group and every descendant, then reaps it."""
    if proc.poll() is None and grace_s > 0:
        # SIGTERM first: torchrun's agent then stops its own workers.
        signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    pids = [*descendants(proc.pid), proc.pid] if proc.poll() is None else []
    for pid in pids:
        signal_group(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def signal_group(pid: int, sig: int) -> None:
    for fn in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            fn(pid, sig)


def kill_logged(log: Path, script: str) -> None:
    """SIGKILLs workers named in ``start`` records that still run ``script`` (orphans)."""
    for r in read_jsonl(log):
        if r.get("event") != "start" or "pid" not in r:
            continue
        try:
            cmdline = Path(f"/proc/{r['pid']}/cmdline").read_bytes()
        except OSError:
            continue  # gone (or not Linux)
        if script.encode() in cmdline:
            signal_group(r["pid"], signal.SIGKILL)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn line being written
    return out


def wait_for(
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
        time.sleep(POLL_S)


def wait_exit(
    procs: list[subprocess.Popen], deadline: float, what: str, log: Path | None = None
) -> None:
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired as err:
            raise TimeoutError(f"{what}: {p.args!r} still running at the deadline") from err
        if p.returncode != 0:
            raise RuntimeError(
                f"{what}: {p.args!r} exited with {p.returncode}{log_tail(log)}"
            )


def log_tail(log: Path | None, lines: int = 25) -> str:
    """The last ``lines`` of a process's log, for an error message ('' if there is none)."""
    if log is None or not log.exists():
        return ""
    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
    return f"; the last lines of {log}:\n" + "\n".join(tail)


def fresh_log(path: Path) -> Path:
    """``path``, emptied: a run's log holds that run's rows alone. The runners append to it
    (a restarted rank goes on in the same file), so a workdir used again would otherwise
    mix an earlier run's steps into this one's figures."""
    path.unlink(missing_ok=True)
    return path


def workdir_path(workdir: str | os.PathLike | None, prefix: str) -> Path:
    if workdir is not None:
        path = Path(workdir)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return Path(tempfile.mkdtemp(prefix=prefix))


def median_or_none(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def recovery_figures(steps: list[dict[str, Any]], t_kill: float) -> dict[str, Any]:
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


ENDLESS = 10**9  # steps: the window's end stops a run, not a step count


def window_open(tail: JsonlTail, warmup: int) -> float | None:
    """``time.time()`` once a committed step ``>= warmup`` is in the log."""
    done = any(
        r.get("event") == "step" and r.get("committed", True) and r["step"] >= warmup
        for r in tail.read()
    )
    return time.time() if done else None


def step_commits(rows: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(r["step"], r["wall"]) for r in rows
            if r.get("event") == "step" and r.get("committed", True)]


def commit_record(row: dict[str, Any], width: int) -> dict[str, Any]:
    """A logged step as a commit record: ``started`` is when the step began."""
    return {"step": row["step"], "wall": row["wall"], "width": width,
            "started": row["wall"] - row["step_ms"] / 1000}
