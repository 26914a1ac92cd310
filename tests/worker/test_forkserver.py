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
import socket
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
torch_preloaded = "torch" in sys.modules
import planaria.config
def group():
    # Empty in the kernel's default group (init's session, as in a container): no nice.
    if not os.path.exists("/proc/self/autogroup"):
        return None
    words = open("/proc/self/autogroup").read().split()
    return words[-1] if words else None
json.dump({"pid": os.getpid(), "torch": torch_preloaded, "argv": sys.argv[1:],
           "cwd": os.getcwd(), "mark": os.environ.get("MARK"),
           "forked": os.environ.get("PLANARIA_FORKED"),
           "idle": os.sched_getscheduler(0) == os.SCHED_IDLE,
           "group": group(),
           "group_var": os.environ.get("PLANARIA_START_GROUP"),
           "loader": type(planaria.config.__loader__).__name__}, open(out + ".tmp", "w"))
os.replace(out + ".tmp", out)
print("hello from the worker", flush=True)
mode = sys.argv[2]
if mode == "exit":
    sys.exit(3)
time.sleep(300)
"""


autogroup = pytest.mark.skipif(not os.path.exists(forkserver.AUTOGROUP),
                               reason="the kernel groups no sessions (CONFIG_SCHED_AUTOGROUP)")


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


def stat_fields(pid: int | str) -> list[str]:
    """``/proc/PID/stat`` after the command's name: state, ppid, pgrp, ... (OSError: gone)."""
    return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    """The process has ended (a zombie whose parent has not reaped it yet counts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if stat_fields(pid)[0] == "Z":
                return True
        except OSError:
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
    assert seen["loader"] == "_CachedSourceLoader"  # planaria's code, compiled by the server
    assert not seen["idle"]  # no START_PRIORITY_VAR: the worker's own priority
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


HOLDER_CHILD = """
import json, os, socket, sys, time
import torch
held = torch.ones(64 << 20)  # 256 MB, every page touched
peer = socket.create_connection(("127.0.0.1", int(sys.argv[1])))  # opened after the holder
peer.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\\n")
time.sleep(300)
"""


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(stat_fields(entry)[2]) == pgid:
                    members.append(int(entry))
            except OSError:
                continue
    return members


def rss_kb(pid: int) -> int:
    for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0  # a zombie: no memory left


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64",
                    reason="the memory holder is x86-64 Linux's (clone with CLONE_VM)")
@pytest.mark.parametrize("ends", ["worker killed", "server killed"])
def test_a_dead_workers_files_close_before_its_memory_goes(
    tmp_path: Path, raylet, ends: str
) -> None:
    """MEMORY_HOLDER_VAR=1: the forked worker starts a process that shares its memory, so
    a SIGKILLed worker's sockets close while the memory is still there (the peer hears at
    once, not after the teardown); the server then kills the worker's group, holder
    included. With the server gone the launcher kills the group instead."""
    listener = socket.create_server(("127.0.0.1", 0))
    script = tmp_path / "holder_child.py"
    script.write_text(HOLDER_CHILD)
    proc = subprocess.Popen(
        [sys.executable, "-S", "-E", forkserver.LAUNCHER, str(script),
         str(listener.getsockname()[1]), f"--session-name=s-{uuid.uuid4().hex[:8]}"],
        env={**os.environ, "RAY_RAYLET_PID": str(raylet.pid),
             forkserver.MEMORY_HOLDER_VAR: "1"},
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    listener.settimeout(120)
    peer, _ = listener.accept()
    peer.settimeout(60)
    worker = json.loads(peer.makefile().readline())["pid"]
    holders = [pid for pid in group_members(worker) if pid != worker]
    assert len(holders) == 1, (worker, holders)
    holder = holders[0]
    assert rss_kb(holder) > 200_000  # the worker's memory: its tensors counted in both
    if ends == "worker killed":
        # The server, stopped, cannot reap the worker and kill its holder before the
        # reading below (it does so at once on SIGCHLD): the memory stays for certain.
        server = int(stat_fields(worker)[1])
        os.kill(server, signal.SIGSTOP)
        try:
            os.kill(worker, signal.SIGKILL)
            assert peer.recv(1) == b""  # the worker's socket closed...
            assert rss_kb(holder) > 200_000  # ...while its memory was still there
        finally:
            os.kill(server, signal.SIGCONT)
        assert proc.wait(timeout=60) == 128 + signal.SIGKILL
    else:
        server = int(stat_fields(worker)[1])  # the worker's parent
        assert server in server_pids(raylet.pid)
        os.kill(server, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        assert peer.recv(1) == b""
    assert gone(worker) and gone(holder), "the worker's memory holder outlived it"
    peer.close()
    listener.close()


@pytest.mark.multiprocess
def test_with_the_server_turned_off_a_worker_starts_cold(tmp_path: Path, raylet) -> None:
    proc, out = launch(tmp_path, raylet.pid, "exit", f"s-{uuid.uuid4().hex[:8]}",
                       PLANARIA_FORKSERVER="0")
    code = proc.wait(timeout=60)
    assert code == 3, proc.stdout.read().decode(errors="replace")
    seen = wait_for(out)
    assert not seen["torch"] and seen["forked"] is None and seen["pid"] == proc.pid
    assert seen["loader"] == "SourceFileLoader"


@pytest.mark.multiprocess
@pytest.mark.skipif(not forkserver.may_raise_priority(),
                    reason="this process may not set a thread back from SCHED_IDLE")
def test_a_joiner_starts_at_idle_priority_and_its_actor_sets_it_back(
    tmp_path: Path, raylet
) -> None:
    """START_PRIORITY_VAR=idle: the forked child runs under SCHED_IDLE from the fork, and
    end_low_priority_start sets every thread (those started meanwhile too) back."""
    proc, out = launch(tmp_path, raylet.pid, "exit", f"s-{uuid.uuid4().hex[:8]}",
                       **{forkserver.START_PRIORITY_VAR: "idle"})
    assert proc.wait(timeout=120) == 3
    seen = wait_for(out)
    assert seen["idle"]
    # Its session's scheduling group too, where the kernel has one (see the next test).
    if seen["group"] is not None:
        assert (seen["group"], seen["group_var"]) == ("19", "nice 19")
    back = subprocess.run([sys.executable, "-c", SET_BACK], capture_output=True, text=True,
                          env={**os.environ, forkserver.START_PRIORITY_VAR: "idle"},
                          timeout=60)
    assert back.returncode == 0, back.stderr
    assert json.loads(back.stdout) == {"raised": "idle", "idle_after": 0, "nice_kept": True}



@autogroup
def test_a_session_leaders_group_is_set_low_and_back() -> None:
    """A forked worker leads its session, so its autogroup is its own: set to nice 19 for
    its start and setup, back to 0 by end_low_priority_setup (which reports what it ran
    at); a process that does not lead its session leaves the group alone (it is shared)."""
    script = """
import json, os
from planaria.worker import forkserver
def group():
    return open(forkserver.AUTOGROUP).read().split()[-1]
led = forkserver.set_session_group_nice(19, wait_s=2.0)
os.environ[forkserver.START_GROUP_VAR] = "nice 19"
low = group()
ended = forkserver.end_low_priority_setup()
print(json.dumps({"led": led, "low": low, "ended": ended, "after": group(),
                  "again": forkserver.end_low_priority_setup()}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, start_new_session=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"led": True, "low": "19", "ended": "nice 19",
                                       "after": "0", "again": "worker"}
    follower = subprocess.run(  # in pytest's session: not its leader, the group is left be
        [sys.executable, "-c", "from planaria.worker import forkserver as f\n"
         "print(f.set_session_group_nice(19, wait_s=0.0))"],
        capture_output=True, text=True, timeout=60)
    assert follower.stdout.strip() == "False", follower.stderr


SET_BACK = """
import json, os, threading
from planaria.worker import forkserver
os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 7)
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
stop = threading.Event()
thread = threading.Thread(target=stop.wait)  # started during the start: idle too
thread.start()
raised = forkserver.end_low_priority_start()
tids = [int(t) for t in os.listdir("/proc/self/task")]
idle_after = sum(os.sched_getscheduler(t) == os.SCHED_IDLE for t in tids)
nice_kept = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 7
stop.set()
thread.join()
print(json.dumps({"raised": raised, "idle_after": idle_after, "nice_kept": nice_kept}))
"""


def test_compiled_sources_serve_unchanged_files_and_compile_changed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "compiledpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "one.py").write_text("VALUE = 1\n")
    (package / "two.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    compiled = forkserver.CompiledSources("compiledpkg")
    assert len(compiled.codes) == 3
    (package / "two.py").write_text("VALUE = 22\n")  # changed after it was compiled
    monkeypatch.setattr(sys, "meta_path", [compiled, *sys.meta_path])
    try:
        import compiledpkg.one
        import compiledpkg.two

        assert compiledpkg.one.VALUE == 1 and compiledpkg.two.VALUE == 22
        assert type(compiledpkg.one.__loader__).__name__ == "_CachedSourceLoader"
    finally:
        for name in ("compiledpkg", "compiledpkg.one", "compiledpkg.two"):
            sys.modules.pop(name, None)


def test_a_worker_imports_none_of_the_controller() -> None:
    """The package's controller entry points (Job, fit, ...) load on first use: a worker
    process, which imports the package too, does not pay for them."""
    script = ("import sys, planaria.worker.actor\n"
              "assert 'planaria.control.job' not in sys.modules, 'the controller was imported'\n"
              "assert 'rich' not in sys.modules\n"
              "from planaria import Job, fit\n"
              "import planaria\n"
              "assert planaria.Job is Job and 'planaria.control.job' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


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
    # A joiner's start priority is the child's, not the server's: the same server forks it.
    assert forkserver.START_PRIORITY_VAR in launch_mod.PER_WORKER_VARS
    assert base == launch_mod.server_address(
        argv, {"PYTHONPATH": "x", forkserver.START_PRIORITY_VAR: "idle"}, "/")


def test_warm_start_must_be_none_or_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="warm_start"):
        RunConfig(steps=1, replicas=1, run_dir=tmp_path, warm_start="yes")  # type: ignore[arg-type]
