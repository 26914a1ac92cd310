"""Ray's own processes die under a job (planaria.control.ray_health, planaria.control.reaper): the
GCS or the raylet of the Ray session the job started is SIGKILLed mid-run, or the controller
itself is. Each time the job ends within a bound: with a save of the step in hand and a
``run_end`` naming what died, and no process of the job left on the machine (checked in /proc
against every process the job started: its Ray session's, its workers, the fork server, the
reaper).

Every job runs in a subprocess of its own session (it starts its own local Ray);
whatever it started is killed at the end of the test, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from planaria.checkpoint import verify_checkpoint
from planaria.control import _reaper
from tests.assertions import events, of

ROOT = Path(__file__).parents[2]
END_BOUND_S = 45.0
"""A job whose GCS or raylet died ends within this (measured: see docs/design.md); Ray's
own end of the controller would come at 60 s, with no save and no run_end."""
REAP_BOUND_S = 10.0
"""A job's processes are gone this long after its controller was (measured: < 1 s)."""

CHILD = r"""
import dataclasses, os, sys, time
from planaria import fit
from planaria.checkpoint.config import CheckpointConfig
from planaria.examples import mlp

run_dir, steps = sys.argv[1], int(sys.argv[2])
address = sys.argv[3] if len(sys.argv) > 3 else None  # a cluster's, else a Ray of its own

def slow_mse(model, batch):  # ~0.05 s steps: a kill lands inside a run of steps
    time.sleep(0.02)
    return mlp.mse(model, batch)

spec = dataclasses.replace(mlp.make_spec(n=512), loss=slow_mse)
warm = {"0": False, "1": True}.get(os.environ.get("TEST_WARM_START", ""))  # None: planaria's
fit(spec, steps=steps, replicas=2, run_dir=run_dir, address=address, warm_start=warm,
    checkpoint=CheckpointConfig(every=5))
"""


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    return None if fields[0] in (b"Z", b"X") else (int(fields[1]), int(fields[19]))


def job_processes(controller: int, worker_pids: list[int]) -> dict[int, int]:
    """pid -> start time of every live process of the job: the controller's descendants,
    the processes that carry its mark (its Ray session's, the fork server, the workers),
    the workers it reported, and their descendants."""
    procs = {int(p): st for p in os.listdir("/proc") if p.isdigit()
             and (st := _stat(int(p))) is not None}
    mark = f"\0{_reaper.OWNER_VAR}={controller}.".encode()
    found = {controller, *(p for p in worker_pids if p in procs)}
    for pid in procs:
        try:
            if mark in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
                found.add(pid)
        except OSError:
            pass
    grew = True
    while grew:
        more = {p for p, (ppid, _) in procs.items() if ppid in found} - found
        found |= more
        grew = bool(more)
    return {p: procs[p][1] for p in found if p in procs}


def ray_process(name: str, pids: list[int]) -> int:
    """Of ``pids``, Ray's ``gcs_server`` or ``raylet``."""
    for pid in pids:
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if argv0.endswith(f"/{name}".encode()):
            return pid
    raise AssertionError(f"no {name} among {pids}")


def holding(directory: str) -> dict[int, int]:
    """pid -> start time of the live processes that name ``directory`` in their command
    line or hold a file under it open (a Ray cluster's, started with it as its temp dir)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid() or (st := _stat(int(name))) is None:
            continue
        try:
            if directory.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                out[int(name)] = st[1]
                continue
            for fd in os.listdir(f"/proc/{name}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{name}/fd/{fd}").startswith(directory):
                        out[int(name)] = st[1]
                        break
        except OSError:
            continue
    return out


def alive(pids: dict[int, int]) -> dict[int, int]:
    return {p: s for p, s in pids.items() if (st := _stat(p)) is not None and st[1] == s}


def wait_gone(pids: dict[int, int], timeout_s: float) -> tuple[dict[int, int], float]:
    """Waits until none of ``pids`` lives; returns those left and the time it took."""
    t0 = time.monotonic()
    while alive(pids) and time.monotonic() - t0 < timeout_s:
        time.sleep(0.05)
    return alive(pids), time.monotonic() - t0


def describe(pids: dict[int, int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:100]
        except OSError:
            cmd = b"?"
        out.append(f"{pid}: {cmd.decode(errors='replace')}")
    return out


def shared_memory_regions() -> set[Path]:
    """The workers' shared-memory regions on this machine (planaria.worker.memory_reserve)."""
    return set(Path("/dev/shm").glob("planaria-reserve-*"))


class Run:
    """A job in a subprocess; every process it started is killed when the test ends, every
    shared-memory region it made removed."""

    def __init__(self, run_dir: Path, steps: int, address: str | None,
                 env: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.seen: dict[int, int] = {}
        self.regions_before = shared_memory_regions()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(run_dir), str(steps),
             *([address] if address else [])],
            env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env}, cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def workers(self) -> list[int]:
        if not (self.run_dir / "events.jsonl").exists():
            return []
        return [e["pid"] for e in of(events(self.run_dir), "worker_started")]

    def processes(self) -> dict[int, int]:
        """The job's processes now (and remembered for the cleanup)."""
        found = job_processes(self.proc.pid, self.workers())
        self.seen.update(found)
        return found

    def wait_step(self, step: int, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.output()
            done = [e["step"] for e in of(events(self.run_dir), "step_committed")] if (
                self.run_dir / "events.jsonl").exists() else []
            if done and max(done) >= step:
                self.processes()
                return
            assert time.monotonic() < deadline, f"step {step} not reached in {timeout_s} s"
            time.sleep(0.1)

    def ray_process(self, name: str) -> int:
        """The pid of the job's Ray ``gcs_server`` or ``raylet`` (a child of the controller)."""
        return ray_process(name, [p for p in self.processes()
                                  if (st := _stat(p)) is not None and st[0] == self.proc.pid])

    def regions_left(self) -> list[str]:
        """The regions made since the job started (another test's are not there: one at a
        time)."""
        return sorted(p.name for p in shared_memory_regions() - self.regions_before)

    def output(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        assert self.proc.stdout is not None
        return self.proc.stdout.read().decode(errors="replace")[-4000:]

    def cleanup(self) -> None:
        """Kills the job and every process of it ever seen or marked as its own now."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.seen.update(job_processes(self.proc.pid, self.workers()))
        for pid in alive(self.seen):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        for path in shared_memory_regions() - self.regions_before:
            path.unlink(missing_ok=True)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Any]:
    runs: list[Run] = []

    def start(steps: int = 100_000, address: str | None = None, **env: str) -> Run:
        r = Run(tmp_path / f"run{len(runs)}", steps, address, env)
        runs.append(r)
        return r

    yield start
    for r in runs:
        r.cleanup()


def ended_for(r: Run, process: str, killed_t: float) -> tuple[float, dict]:
    """Waits for the job to end after ``process`` was killed (at ``killed_t``); checks its
    error and run_end; returns how long it took to end and the run_end record."""
    t0 = time.monotonic()
    try:
        r.proc.wait(timeout=END_BOUND_S + 30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job did not end {END_BOUND_S + 30:.0f} s after its {process} died")
    took = time.monotonic() - t0
    out = r.output()
    assert r.proc.returncode == 1, out
    assert "RayLost" in out and process in out, out
    evs = events(r.run_dir)
    lost = of(evs, "ray_lost")
    assert [e["process"] for e in lost] == [process], lost
    end = of(evs, "run_end")
    assert len(end) == 1 and end[0]["status"] == "aborted", end
    assert "RayLost" in end[0]["error"] and process in end[0]["error"], end[0]
    saved = [e["t"] - killed_t for e in of(evs, "checkpoint_saved") if e["reason"] == "ray_lost"]
    print(f"{process} killed: ray_lost after {lost[0]['t'] - killed_t:.2f} s, saved after "
          f"{saved[0] if saved else float('nan'):.2f} s, run_end after "
          f"{end[0]['t'] - killed_t:.2f} s, the controller gone after {took:.2f} s")
    return took, end[0]


def assert_saved_in_hand(r: Run, end: dict) -> None:
    """The end saved the step in hand: a committed, verified checkpoint of the last step."""
    evs = events(r.run_dir)
    last = max(e["step"] for e in of(evs, "step_committed")) + 1
    saves = [e for e in of(evs, "checkpoint_saved") if e["reason"] == "ray_lost"]
    assert len(saves) == 1, (saves, end["error"])
    assert saves[0]["step"] == last == end["step"], (saves, last, end)
    assert verify_checkpoint(saves[0]["path"]).ok
    assert f"step {last} was saved" in end["error"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_gcs_killed_mid_run_ends_the_job_with_a_save_and_leaves_nothing(run) -> None:
    r = run()
    r.wait_step(12)
    before = r.processes()
    gcs = r.ray_process("gcs_server")
    killed_t = time.time()
    os.kill(gcs, signal.SIGKILL)
    took, end = ended_for(r, "gcs_server", killed_t)
    assert took < END_BOUND_S, f"the job took {took:.1f} s to end after its GCS died"
    assert_saved_in_hand(r, end)
    left, waited = wait_gone(before, REAP_BOUND_S)
    assert not left, f"left {waited:.1f} s after the end: {describe(left)}"
    assert not r.regions_left(), r.regions_left()  # its workers' memory is freed too
    print(f"GCS killed: the job ended in {took:.1f} s, all its {len(before)} processes gone")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("warm", ["1", pytest.param("0", marks=pytest.mark.extended)],
                         ids=["forked", "cold"])
def test_the_raylet_killed_mid_run_ends_the_job_with_a_save_and_leaves_nothing(
    run, warm: str
) -> None:
    r = run(TEST_WARM_START=warm)
    r.wait_step(12)
    before = r.processes()
    raylet = r.ray_process("raylet")
    killed_t = time.time()
    os.kill(raylet, signal.SIGKILL)
    took, end = ended_for(r, "raylet", killed_t)
    assert took < END_BOUND_S, f"the job took {took:.1f} s to end after its raylet died"
    assert_saved_in_hand(r, end)
    left, waited = wait_gone(before, REAP_BOUND_S)
    assert not left, f"left {waited:.1f} s after the end: {describe(left)}"
    assert not r.regions_left(), r.regions_left()  # its workers' memory is freed too
    print(f"raylet killed: the job ended in {took:.1f} s, all its {len(before)} processes gone")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("target", [pytest.param("group", marks=pytest.mark.extended), "pid"])
def test_a_sigkilled_controller_leaves_no_process_of_its_job(run, target: str) -> None:
    r = run()
    r.wait_step(12)
    before = r.processes()
    assert len(before) >= 8, describe(before)  # Ray's daemons and agents, workers, reaper
    t0 = time.monotonic()
    if target == "group":  # the controller's process group, as a job kill
        os.killpg(r.proc.pid, signal.SIGKILL)
    else:  # the controller alone (the OOM killer)
        os.kill(r.proc.pid, signal.SIGKILL)
    r.proc.wait(timeout=30)
    left, took = wait_gone(before, REAP_BOUND_S)
    assert not left, f"left {took:.1f} s after the controller's SIGKILL: {describe(left)}"
    reaped = of(events(r.run_dir), "reaped")
    assert len(reaped) == 1 and reaped[0]["controller"] == r.proc.pid
    # the workers' shared-memory regions removed by the reaper (2 workers: one each)
    assert reaped[0]["regions_removed"] >= 2 and not r.regions_left(), r.regions_left()
    print(f"controller killed ({target}): its {len(before)} processes gone in "
          f"{time.monotonic() - t0:.2f}"
          f" s (the reaper's sweep {reaped[0]['sweep_s']} s)")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_normal_end_leaves_no_process_and_the_reaper_gone(run) -> None:
    r = run(steps=30)
    r.wait_step(3)
    before = r.processes()
    reaper = [p for p in before if b"_reaper.py" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(reaper) == 1, describe(before)
    assert r.proc.wait(timeout=180) == 0, r.output()
    left, took = wait_gone(before, REAP_BOUND_S)
    assert not left, f"left {took:.1f} s after a normal end: {describe(left)}"
    assert not of(events(r.run_dir), "reaped")  # the reaper left without killing
    assert of(events(r.run_dir), "run_end")[0]["status"] == "ok"


CLUSTER_ENV = {"RAY_AUTH_MODE": "disabled"}  # no token to hand to the job's driver


@pytest.fixture
def cluster() -> Iterator[tuple[str, str]]:
    """A Ray cluster of its own (``ray start --head``), not the job's: (its address, its
    temp dir). Every process of it is killed at the end."""
    temp = tempfile.mkdtemp(prefix="prd-", dir="/tmp")  # short: Ray's socket paths
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
             f"--temp-dir={temp}", "--num-cpus=4", "--include-dashboard=false",
             "--disable-usage-stats", "--node-ip-address=127.0.0.1"],
            check=True, capture_output=True, timeout=180, env={**os.environ, **CLUSTER_ENV},
        )
        yield f"127.0.0.1:{port}", temp
    finally:
        for pid in holding(temp):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.extended
def test_the_gcs_of_a_cluster_killed_ends_the_job_and_leaves_the_cluster_alone(
    run, cluster
) -> None:
    address, temp = cluster
    # Ray would end the controller 30 s after losing the GCS: the job ends 10 s before.
    r = run(address=address, RAY_gcs_rpc_server_reconnect_timeout_s="30", **CLUSTER_ENV)
    r.wait_step(12)
    before = r.processes()
    theirs = holding(temp)
    gcs = ray_process("gcs_server", list(theirs))
    raylet = ray_process("raylet", list(theirs))
    killed_t = time.time()
    os.kill(gcs, signal.SIGKILL)
    took, end = ended_for(r, "gcs_server", killed_t)
    assert 15.0 <= took < 15.0 + END_BOUND_S, f"the job ended {took:.1f} s after its GCS died"
    assert_saved_in_hand(r, end)
    left, waited = wait_gone(before, REAP_BOUND_S)  # its workers, the fork server, the reaper
    assert not left, f"left {waited:.1f} s after the end: {describe(left)}"
    assert raylet not in before and alive({raylet: theirs[raylet]}), (
        "the cluster's raylet was killed: not the job's")
    print(f"a cluster's GCS killed: the job ended in {took:.1f} s, its {len(before)} processes "
          f"gone, the cluster's {len(set(theirs) - set(before))} left to it")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.extended
def test_the_raylet_killed_with_every_worker_ends_the_job_saying_the_newest_save_stands(
    run,
) -> None:
    r = run()
    r.wait_step(12)
    before = r.processes()
    raylet = r.ray_process("raylet")
    killed_t = time.time()
    for pid in [raylet, *r.workers()]:  # the node gone at once: nothing left to save from
        os.kill(pid, signal.SIGKILL)
    took, end = ended_for(r, "raylet", killed_t)
    assert took < END_BOUND_S, f"the job took {took:.1f} s to end after its raylet died"
    evs = events(r.run_dir)
    assert not [e for e in of(evs, "checkpoint_saved") if e["reason"] == "ray_lost"]
    newest = max(e["step"] for e in of(evs, "checkpoint_saved"))
    assert "nothing was saved" in end["error"], end["error"]
    assert f"the newest committed checkpoint, step {newest}, stands" in end["error"], end["error"]
    left, waited = wait_gone(before, REAP_BOUND_S)
    assert not left, f"left {waited:.1f} s after the end: {describe(left)}"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.extended
def test_the_raylet_of_a_cluster_killed_ends_the_job_and_leaves_its_gcs_alone(
    run, cluster
) -> None:
    address, temp = cluster
    r = run(address=address, **CLUSTER_ENV)
    r.wait_step(12)
    before = r.processes()
    theirs = holding(temp)
    gcs = ray_process("gcs_server", list(theirs))
    raylet = ray_process("raylet", list(theirs))
    killed_t = time.time()
    os.kill(raylet, signal.SIGKILL)
    took, end = ended_for(r, "raylet", killed_t)
    assert took < END_BOUND_S, f"the job ended {took:.1f} s after its raylet died"
    assert_saved_in_hand(r, end)
    left, waited = wait_gone(before, REAP_BOUND_S)  # its workers, the fork server, the reaper
    assert not left, f"left {waited:.1f} s after the end: {describe(left)}"
    assert gcs not in before and alive({gcs: theirs[gcs]}), (
        "the cluster's GCS was killed: not the job's")


# ---- no Ray ----------------------------------------------------------------------------------


def test_a_clusters_gcs_is_given_most_of_rays_own_reconnect_timeout(monkeypatch) -> None:
    from planaria.control.ray_health import RECONNECT_VAR, gcs_grace_s

    for reconnect, grace in (("60", 40.0), ("30", 15.0), ("600", 580.0), ("bad", 40.0)):
        monkeypatch.setenv(RECONNECT_VAR, reconnect)
        assert gcs_grace_s() == grace
    monkeypatch.delenv(RECONNECT_VAR)
    assert gcs_grace_s() == 40.0


def test_ray_lost_keeps_what_died_across_pickling() -> None:
    import pickle

    from planaria import ElasticRuntimeError, RayLost

    err = pickle.loads(pickle.dumps(RayLost("the GCS died", process="gcs_server", pid=7,
                                            saved="/ckpt/step_000000010")))
    assert isinstance(err, ElasticRuntimeError) and str(err) == "the GCS died"
    assert (err.process, err.pid, err.saved) == ("gcs_server", 7, "/ckpt/step_000000010")
