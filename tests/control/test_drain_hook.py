"""``planaria node-drain-hook`` as a preStop hook, against real processes that leave worker
markers as planaria's workers do (no Ray: the hook's own part); the same hook wrapping a
real ``ray start`` under a job is in tests/control/test_node_drain.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from planaria import RunConfig
from planaria.control.drain import NodeDrainWatch
from planaria.faults.errors import ConfigError
from planaria.wire.worker_markers import live_workers

pytestmark = pytest.mark.slow  # each hook is a fresh process importing planaria (seconds)

ROOT = Path(__file__).resolve().parents[2]

# A stand-in worker process: leaves its marker, then on SIGTERM writes a file and leaves
# (or, with IGNORE, stays).
WORKER = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    from planaria.wire.worker_markers import register_worker
    name, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    def on_term(signum, frame):
        (out / name).write_text("SIGTERM")
        if mode != "ignore":
            sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    register_worker(name, node_id=None, gcs_address=None)
    print("ready", flush=True)
    time.sleep(120)
""")


def _env(folder: Path) -> dict[str, str]:
    env = dict(os.environ, PLANARIA_WORKER_DIR=str(folder))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p
    )
    return env


def _start(name: str, folder: Path, out: Path, mode: str = "leave") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WORKER, name, str(out), mode],
                            env=_env(folder), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _hook(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "planaria.cli.main", "node-drain-hook", *args],
        env=_env(folder), capture_output=True, text=True, timeout=60,
    )


def test_prestop_hook_gives_every_worker_its_notice_and_waits(tmp_path):
    folder, out = tmp_path / "markers", tmp_path / "out"
    out.mkdir()
    gone = _start("w9", folder, out)
    gone.kill()  # a worker SIGKILLed earlier: its marker stays behind, stale
    gone.wait()
    workers = [_start(f"w{i}", folder, out) for i in range(2)]
    try:
        assert [m.name for m in live_workers(folder)] == ["w0", "w1"]
        assert not (folder / str(gone.pid)).exists(), "a stale marker was not removed"
        t0 = time.monotonic()
        done = _hook(folder, "--grace-s", "60")
        assert done.returncode == 0, done.stdout + done.stderr
        # It returned once the workers left, well before its grace ran out (15 s was too
        # tight for a machine under load: 15.3 s at load 15).
        assert time.monotonic() - t0 < 45
        assert sorted(p.name for p in out.iterdir()) == ["w0", "w1"]
        assert all(w.wait(timeout=5) == 0 for w in workers)
        assert "every planaria worker on this node has left" in done.stdout
        assert live_workers(folder) == []
    finally:
        for w in workers:
            w.kill()


@pytest.mark.extended
def test_prestop_hook_says_which_workers_did_not_leave(tmp_path):
    folder, out = tmp_path / "markers", tmp_path / "out"
    out.mkdir()
    stubborn = _start("w4", folder, out, mode="ignore")
    try:
        done = _hook(folder, "--grace-s", "1")
        assert done.returncode == 1
        assert "w4 still running after 1 s" in done.stdout
        assert (out / "w4").read_text() == "SIGTERM"
    finally:
        stubborn.kill()
        stubborn.wait()


@pytest.mark.extended
def test_wrapper_forwards_sigterm_after_the_workers_left(tmp_path):
    """The node's entrypoint under the hook: the workers first, then the entrypoint."""
    folder, out = tmp_path / "markers", tmp_path / "out"
    out.mkdir()
    worker = _start("w0", folder, out)
    entry = ("import signal, sys, time, pathlib\n"
             f"out = pathlib.Path({str(out)!r})\n"
             "def bye(s, f):\n"
             "    (out / 'entrypoint').write_text(str(sorted(p.name for p in out.iterdir())))\n"
             "    sys.exit(7)\n"
             "signal.signal(signal.SIGTERM, bye)\n"
             "print('up', flush=True)\n"
             "time.sleep(60)\n")
    hook = subprocess.Popen(
        [sys.executable, "-m", "planaria.cli.main", "node-drain-hook", "--grace-s", "20",
         "--no-ray-drain", "--", sys.executable, "-c", entry],
        env=_env(folder), stdout=subprocess.PIPE, text=True,
    )
    try:
        assert hook.stdout is not None and hook.stdout.readline().strip() == "up"
        hook.terminate()
        assert hook.wait(timeout=30) == 7  # the entrypoint's own exit status
        assert worker.wait(timeout=5) == 0
        assert (out / "entrypoint").read_text() == "['w0']"  # the worker had its notice first
    finally:
        for p in (hook, worker):
            if p.poll() is None:
                p.kill()


def test_bad_input_names_the_problem_and_the_fix(tmp_path):
    done = _hook(tmp_path, "--grace-s", "0")
    assert done.returncode == 2 and "--grace-s=0.0 is not valid" in done.stderr
    done = _hook(tmp_path, "--", str(tmp_path / "no-such-entrypoint"))
    assert done.returncode == 2
    assert "cannot run" in done.stderr and "planaria node-drain-hook -- ray start" in done.stderr
    with pytest.raises(ConfigError, match="drain_poll_s=0 is not valid"):
        RunConfig(steps=1, replicas=1, run_dir=tmp_path, drain_poll_s=0)
    with pytest.raises(ConfigError, match="drain_poll_s=-1 is not valid"):
        NodeDrainWatch(-1)


def test_the_drain_watch_keeps_the_last_answer_when_a_query_fails():
    answers: list[object] = [{"n1": 0}, RuntimeError("GCS unreachable"), {"n1": 0, "n2": 5}]

    def query() -> dict[str, int]:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a  # type: ignore[return-value]

    watch = NodeDrainWatch(3600, query=query)  # polled by hand here
    try:
        assert watch.poll_now() == {"n1": 0}
        assert watch.poll_now() == {"n1": 0}
        assert watch.poll_now() == {"n1": 0, "n2": 5}
    finally:
        watch.stop()
