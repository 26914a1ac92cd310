"""Warm starts (planaria.worker.forkserver): the launcher Ray runs for a worker has the node's fork
server fork it with torch already imported, with the launcher's arguments, environment,
directory and streams; exit codes and signals pass through, a killed launcher takes its
worker with it, and whatever stands in the way starts the worker cold, as Ray would.

These run the launcher and the server as real processes, without Ray (Ray's side is in
tests/control/test_spares.py, whose workers all start through the server)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from planaria import ConfigError, RunConfig
from planaria.worker import forkserver

CHILD = """
import json, os, signal, sys, time
out = sys.argv[1]
def on_term(*_):
    open(out + ".term", "w").write("1")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
json.dump({"pid": os.getpid(), "torch": "torch" in sys.modules, "argv": sys.argv[1:],
           "cwd": os.getcwd(), "mark": os.environ.get("MARK"),
           "forked": os.environ.get("PLANARIA_FORKED")}, open(out + ".tmp", "w"))
os.replace(out + ".tmp", out)
print("hello from the worker", flush=True)
mode = sys.argv[2]
if mode == "exit":
    sys.exit(3)
time.sleep(300)
"""


@pytest.fixture
def raylet(tmp_path: Path):
    """A stand-in for the raylet: the server lives while this process does."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


def launch(tmp_path: Path, raylet_pid: int, mode: str, session: str, **env: str):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = tmp_path / f"{mode}.json"
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-S", "-E", forkserver.LAUNCHER, str(script), str(out), mode,
         f"--session-name={session}"],
        env={**os.environ, "RAY_RAYLET_PID": str(raylet_pid), "MARK": "m1", **env},
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    return proc, out


def wait_for(path: Path, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return json.loads(path.read_text())


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def server_pids(raylet_pid: int) -> list[int]:
    """The fork servers serving this raylet."""
    pids = []
    for pid in os.listdir("/proc"):
        try:
            cmd = (Path("/proc") / pid / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(cmd) > 3 and cmd[1].endswith(b"forkserver.py") and cmd[3] == b"%d" % raylet_pid:
            pids.append(int(pid))
    return pids


@pytest.mark.multiprocess
def test_a_forked_worker_runs_warm_as_the_launcher_would_and_passes_its_exit_code_back(
    tmp_path: Path, raylet
) -> None:
    session = f"s-{uuid.uuid4().hex[:8]}"
    proc, out = launch(tmp_path, raylet.pid, "exit", session)
    assert proc.wait(timeout=120) == 3
    seen = wait_for(out)
    assert seen["torch"] and seen["forked"] == "1"  # preloaded: imported before it ran
    assert seen["pid"] != proc.pid
    assert seen["argv"] == [str(out), "exit", f"--session-name={session}"]
    assert seen["cwd"] == str(tmp_path / "cwd") and seen["mark"] == "m1"
    assert b"hello from the worker" in proc.stdout.read()  # the launcher's streams
    # A second worker of the same session and environment is forked by the same server.
    before = set(server_pids(raylet.pid))
    assert len(before) == 1
    proc2, out2 = launch(tmp_path, raylet.pid, "exit", session)
    assert proc2.wait(timeout=60) == 3 and wait_for(out2)["forked"] == "1"
    assert set(server_pids(raylet.pid)) == before
    # The server leaves with its raylet.
    raylet.kill()
    raylet.wait()
    assert all(gone(pid) for pid in before), f"the server {before} outlived its raylet"


@pytest.mark.multiprocess
def test_a_killed_launcher_takes_its_worker_along_and_signals_reach_the_worker(
    tmp_path: Path, raylet
) -> None:
    session = f"s-{uuid.uuid4().hex[:8]}"
    proc, out = launch(tmp_path, raylet.pid, "sleep", session)
    worker = wait_for(out)["pid"]
    proc.kill()  # SIGKILL: what Ray does to a worker process it gives up on
    proc.wait()
    assert gone(worker), "the forked worker outlived the process Ray knows"

    term_dir = tmp_path / "term"
    term_dir.mkdir()
    proc, out = launch(term_dir, raylet.pid, "sleep", session)
    worker = wait_for(out)["pid"]
    proc.send_signal(signal.SIGTERM)  # a preemption notice, sent to the process Ray knows
    assert proc.wait(timeout=30) == 0
    assert Path(str(out) + ".term").exists() and gone(worker)


@pytest.mark.multiprocess
def test_with_the_server_turned_off_a_worker_starts_cold(tmp_path: Path, raylet) -> None:
    proc, out = launch(tmp_path, raylet.pid, "exit", f"s-{uuid.uuid4().hex[:8]}",
                       PLANARIA_FORKSERVER="0")
    assert proc.wait(timeout=60) == 3
    seen = wait_for(out)
    assert not seen["torch"] and seen["forked"] is None and seen["pid"] == proc.pid


def test_a_process_with_threads_is_not_forked_from() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not forkserver.single_threaded()
    finally:
        stop.set()
        thread.join()


def test_the_launcher_names_a_server_per_session_and_environment() -> None:
    from planaria.worker import _forkserver_launch as launch_mod

    argv = ["w.py", "--session-name=a"]
    base = launch_mod.server_address(argv, {"PYTHONPATH": "x"}, "/")
    assert base.startswith("\0planaria-forkserver-")
    assert base == launch_mod.server_address(argv, {"PYTHONPATH": "x", "HOME": "/h"}, "/")
    assert base != launch_mod.server_address(["w.py", "--session-name=b"], {"PYTHONPATH": "x"}, "/")
    assert base != launch_mod.server_address(argv, {"PYTHONPATH": "y"}, "/")
    assert base != launch_mod.server_address(argv, {"PYTHONPATH": "x", "TORCH_X": "1"}, "/")


def test_warm_start_must_be_none_or_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="warm_start"):
        RunConfig(steps=1, replicas=1, run_dir=tmp_path, warm_start="yes")  # type: ignore[arg-type]
