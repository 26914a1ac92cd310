"""Nothing of a job outlives its controller (planaria.control.reaper): a SIGKILLed controller's
processes on the machine are killed within a bounded time by its reaper, and only
those; a normal close leaves the reaper gone and kills nothing.

The first tests run the reaper against plain processes (no Ray); the last runs a real
job in a subprocess and SIGKILLs its controller."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from planaria.control import _reaper
from tests.assertions import events, of

SRC = str(Path(__file__).parents[2] / "src")
REAP_BOUND_S = 5.0
"""A killed controller's processes are gone within this (measured: ~0.1-0.3 s)."""

# A stand-in controller: starts a reaper, a marked child with a grandchild, a reported
# child, and an unrelated child (another job's mark); names its shared-memory regions
# (job-a-*; job-b-0 is another job's); prints their pids; then either waits to be killed
# or closes its reaper normally and waits.
CONTROLLER = r"""
import json, os, subprocess, sys, time
from pathlib import Path
from planaria.control.reaper import Reaper
out, mode = Path(sys.argv[1]), sys.argv[2]
reaper = Reaper(out / "events.jsonl")
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
parent = [sys.executable, "-c",
          "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(600)",
          *sleeper]
with reaper.marking():
    marked = subprocess.Popen(parent, start_new_session=True)
reported = subprocess.Popen(sleeper, start_new_session=True)
reaper.watch(reported.pid)
regions = out / "regions"
regions.mkdir()
for name in ("job-a-0", "job-a-1", "job-b-0"):
    (regions / name).write_bytes(b"state")
reaper.regions(str(regions / "job-a-*"))
other = subprocess.Popen(sleeper, env={**os.environ, "PLANARIA_OWNER": "another-job"},
                         start_new_session=True)
def children(pid):
    out = []
    for p in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{p}/stat").read() if p.isdigit() else ""
            if stat and stat.rsplit(")", 1)[1].split()[1] == str(pid):
                out.append(int(p))
        except OSError:
            pass
    return out
kids = []
deadline = time.monotonic() + 60
while not kids and time.monotonic() < deadline:
    kids = children(marked.pid)
    time.sleep(0.05)
pids = {"controller": os.getpid(), "reaper": reaper.reaper_pid, "marked": marked.pid,
        "grandchild": kids[0], "reported": reported.pid, "other": other.pid}
(out / "pids.json.tmp").write_text(json.dumps(pids))
os.replace(out / "pids.json.tmp", out / "pids.json")
if mode == "close":
    reaper.close()
    (out / "closed").write_text("1")
time.sleep(600)
"""


def alive(pid: int, start: int | None) -> bool:
    return start is not None and _reaper.start_time(pid) == start


def wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.fixture
def processes() -> Iterator[dict[int, int]]:
    """pid -> start time of every process a test starts: killed at the end, whatever
    happened (a pid is killed only while it is the same process)."""
    started: dict[int, int] = {}
    yield started
    for pid, start in started.items():
        if alive(pid, start):
            os.kill(pid, signal.SIGKILL)


def start_controller(tmp_path: Path, mode: str, processes: dict[int, int]) -> dict[str, int]:
    proc = subprocess.Popen([sys.executable, "-c", CONTROLLER, str(tmp_path), mode],
                            env={**os.environ, "PYTHONPATH": SRC}, start_new_session=True)
    processes[proc.pid] = _reaper.start_time(proc.pid) or 0
    try:
        wait_for(tmp_path / "pids.json")
    finally:  # whatever it started is killed at the end, even if this fails
        if (tmp_path / "pids.json").exists():
            pids = json.loads((tmp_path / "pids.json").read_text())
            for pid in pids.values():
                if pid is not None and (start := _reaper.start_time(pid)) is not None:
                    processes.setdefault(pid, start)
    pids["_popen"] = proc  # type: ignore[assignment]
    return pids


@pytest.mark.multiprocess
def test_a_killed_controller_leaves_nothing_of_its_job_and_spares_the_rest(
    tmp_path: Path, processes: dict[int, int]
) -> None:
    pids = start_controller(tmp_path, "wait", processes)
    proc = pids.pop("_popen")  # type: ignore[arg-type]
    starts = {name: _reaper.start_time(pid) for name, pid in pids.items()}
    assert all(alive(pid, starts[name]) for name, pid in pids.items())
    t0 = time.monotonic()
    os.killpg(pids["controller"], signal.SIGKILL)  # the controller's whole process group
    proc.wait()
    job = ("marked", "grandchild", "reported", "reaper")
    while any(alive(pids[n], starts[n]) for n in job) and time.monotonic() - t0 < REAP_BOUND_S:
        time.sleep(0.02)
    took = time.monotonic() - t0
    left = [n for n in job if alive(pids[n], starts[n])]
    assert not left, f"{left} outlived their controller by {took:.1f} s"
    assert alive(pids["other"], starts["other"]), "another job's process was killed"
    reaped = of(events(tmp_path), "reaped")
    assert len(reaped) == 1 and reaped[0]["controller"] == pids["controller"]
    assert {pids["marked"], pids["grandchild"], pids["reported"]} <= set(reaped[0]["killed"])
    assert pids["other"] not in reaped[0]["killed"]
    assert reaped[0]["regions_removed"] == 2  # its regions, not another job's
    assert sorted(p.name for p in (tmp_path / "regions").iterdir()) == ["job-b-0"]
    print(f"reaped in {took:.2f} s (sweep {reaped[0]['sweep_s']} s)")


@pytest.mark.multiprocess
def test_a_normal_close_leaves_the_reaper_gone_and_kills_nothing(
    tmp_path: Path, processes: dict[int, int]
) -> None:
    pids = start_controller(tmp_path, "close", processes)
    pids.pop("_popen")
    wait_for(tmp_path / "closed")
    starts = {name: _reaper.start_time(pid) for name, pid in pids.items()}
    assert starts["reaper"] is None, "the reaper outlived a normal close"
    for name in ("controller", "marked", "grandchild", "reported", "other"):
        assert starts[name] is not None, f"{name} was killed by a normal close"
    assert not (tmp_path / "events.jsonl").exists() or not of(events(tmp_path), "reaped")
    assert len(list((tmp_path / "regions").iterdir())) == 3  # the controller removes them


def test_a_sweep_never_matches_the_excluded_nor_a_reused_pid(processes: dict[int, int]) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    start = _reaper.start_time(child.pid)
    assert start is not None
    processes[child.pid] = start
    assert _reaper.job_processes(None, {child.pid: start}, set()) == [child.pid]
    assert _reaper.job_processes(None, {child.pid: start}, {child.pid}) == []
    assert _reaper.job_processes(None, {child.pid: start + 1}, set()) == []  # a reused pid
    assert _reaper.job_processes("no-such-job", {}, set()) == []
    child.kill()
    child.wait()
