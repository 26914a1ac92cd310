"""Full disks, on real small tmpfs mounts: a run directory that fills degrades its writers
to warnings and the job still releases every process; a checkpoint root that fills at the
final save leaves the job open with its trained state, which is saved elsewhere.

Mounting needs root (CAP_SYS_ADMIN, as in CI); elsewhere the tests skip, saying why.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from planaria import CheckpointError, FinalSaveFailed, fit
from planaria.checkpoint import list_checkpoints, load_checkpoint
from planaria.checkpoint.config import CheckpointConfig
from planaria.data.plan import Ledger
from planaria.examples import mlp
from planaria.observe.events import EventLog, read_events
from tests.assertions import events, of

N = 512


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` for the block; skips the test where mounting
    is not permitted."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command: the full-disk tests mount a small tmpfs")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({done.stderr.strip() or done.returncode}): the "
                    "full-disk tests need root (CAP_SYS_ADMIN)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def fill(path: Path) -> None:
    """Writes ``path`` until its file system has no block left."""
    with path.open("wb", buffering=0) as f:
        while True:
            try:
                f.write(b"\0" * 4096)
            except OSError as err:
                assert err.errno == errno.ENOSPC, err
                return


def test_a_full_run_dir_holds_its_records_and_writes_them_once_it_has_room(tmp_path):
    """While the run dir is full the event log and the ledger hold their records in memory
    (the ledger is the proof that each sample was used once: it loses none); once there is
    room they are written first, in order. Past the hold, records are dropped, counted and
    the gap noted."""
    with tmpfs(tmp_path / "run", "64k") as run_dir:
        log = EventLog(run_dir)
        ledger = Ledger(run_dir, run_id="r")
        log.emit("run_start", run_id="r")
        fill(run_dir / "filler")
        for step in range(5):  # each record needs a block the disk no longer has
            log.emit("step_committed", step=step, note="x" * 5000)
            ledger.commit(step, gen=0)
        assert log.dropped == 0 and ledger.dropped == 0
        lines = (run_dir / "events.jsonl").read_text().splitlines()
        assert [json.loads(line)["event"] for line in lines] == ["run_start"]  # nothing torn
        (run_dir / "filler").unlink()  # space again: the held records, then the next
        log.emit("step_committed", step=5)
        ledger.commit(5, gen=0)
        log.close()
        ledger.close()
        names = [(e["event"], e.get("step")) for e in read_events(run_dir)]
        assert names == [("run_start", None), *[("step_committed", s) for s in range(6)]]
        assert sorted(Ledger.committed(run_dir)) == list(range(6))


def test_records_past_the_hold_are_dropped_counted_and_the_gap_noted(tmp_path):
    from planaria.observe.append_file import AppendFile

    with tmpfs(tmp_path / "run", "64k") as run_dir:
        gaps: list[int] = []
        f = AppendFile(run_dir / "log.jsonl", what="a log", hold_bytes=12_000,
                       on_gap=lambda n, since: gaps.append(n))
        fill(run_dir / "filler")
        for i in range(5):
            assert not f.write_line(json.dumps({"i": i, "pad": "x" * 5000}))
        assert f.held == 2 and f.dropped == 3  # two fit in the hold
        (run_dir / "filler").unlink()
        assert f.write_line(json.dumps({"i": 5}))
        f.close()
        got = [json.loads(line)["i"] for line in (run_dir / "log.jsonl").read_text().splitlines()]
        assert got == [0, 1, 5] and gaps == [3]


_FILLING_RUN = '''
import json, os, sys, time
from planaria import fit
from planaria.examples import mlp

outcome = {}
try:
    result = fit(mlp.make_spec(n=512), steps=int(sys.argv[2]), replicas=3, run_dir=sys.argv[1],
                 ledger=True)
    outcome["final_step"] = result.final_step
except Exception as err:
    outcome["error"] = f"{type(err).__name__}: {err}"

mark = ("PLANARIA_TEST_TAG=" + os.environ["PLANARIA_TEST_TAG"]).encode()

def left():
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\\0", b" ")[:100].decode(errors="replace")
        except OSError:
            continue
        if mark in env and state != "Z":
            out.append(f"{pid} {cmd}")
    return out

end = time.monotonic() + 60  # Ray's processes stop in the background after ray.shutdown
while (alive := left()) and time.monotonic() < end:
    time.sleep(0.5)
outcome["left"] = alive
print("OUTCOME " + json.dumps(outcome), flush=True)
'''


def _tagged(tag: str) -> list[int]:
    mark = f"PLANARIA_TEST_TAG={tag}".encode()
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(int(pid))
        except OSError:
            continue
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_run_dir_that_fills_leaves_the_run_going_and_no_process_behind(tmp_path):
    """A controller whose run directory (events, ledger, ray.log) fills part-way: the run
    trains to its end (records dropped, with one warning), and once fit has returned no
    worker, fork server or Ray process of the job is left (checked from the controller
    itself, then again after it exited)."""
    tag = uuid.uuid4().hex
    steps = 120
    with tmpfs(tmp_path / "run", "96k") as run_dir:
        script = tmp_path / "filling_run.py"
        script.write_text(_FILLING_RUN)
        env = {**os.environ, "PLANARIA_TEST_TAG": tag, "RAY_ADDRESS": ""}
        done = subprocess.run([sys.executable, str(script), str(run_dir), str(steps)], env=env,
                              capture_output=True, text=True, timeout=280)
        line = next((x for x in done.stdout.splitlines() if x.startswith("OUTCOME ")), None)
        assert line is not None, done.stdout[-2000:] + done.stderr[-4000:]
        outcome = json.loads(line.removeprefix("OUTCOME "))
        assert outcome.get("final_step") == steps, outcome
        assert outcome["left"] == [], outcome["left"]
        # The ledger alone (three served records of ~320 bytes a step) outgrows the disk: it
        # fails, whatever else (the event log, ray.log) fills it first.
        assert "cannot write the ledger" in done.stderr, done.stderr[-3000:]
        for text in (run_dir / "events.jsonl").read_text().splitlines():
            json.loads(text)  # whole lines only, although writes failed part-way
        assert shutil.disk_usage(run_dir).free < 8192  # it did fill
    end = time.monotonic() + 30
    while (alive := _tagged(tag)) and time.monotonic() < end:
        time.sleep(0.5)
    assert alive == []


@pytest.fixture(scope="module")
def reference10(tmp_path_factory, ray_cluster):
    return fit(mlp.make_spec(n=N), steps=10, replicas=2,
               run_dir=tmp_path_factory.mktemp("ref10")).state_dict


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_final_save_on_a_full_root_keeps_the_trained_state_to_save_elsewhere(
        tmp_path, reference10):
    """A checkpoint root with room for one checkpoint (~265 KB) of two: the save at step 5
    commits, the final one (step 10) fails with ENOSPC. fit raises FinalSaveFailed with the
    job still open; its state, saved elsewhere, is the trained state (the fault-free run's),
    and a job given that root resumes from it."""
    with tmpfs(tmp_path / "root", "400k") as root:
        cfg = CheckpointConfig(root=str(root), every=5, storage_attempts=1)
        with pytest.raises(FinalSaveFailed, match="save it elsewhere") as info:
            fit(mlp.make_spec(n=N), steps=10, replicas=2, run_dir=tmp_path / "run",
                checkpoint=cfg)
        err = info.value
        try:
            assert err.step == 10 and err.newest_step == 5
            assert err.newest_path == str(root / "step_000000005")
            assert [c.step for c in list_checkpoints(str(root)) if c.committed] == [5]
            trained, _ = err.job.state()
            with pytest.raises(CheckpointError, match="step 10 was not committed"):
                err.job.save()  # its own root is still full: the job and its state stay
            path = err.job.save(root=str(tmp_path / "elsewhere"))
        finally:
            err.job.close()
    assert path == str(tmp_path / "elsewhere" / "step_000000010")
    saved, meta = load_checkpoint(path)
    assert meta["steps_done"] == 10 and saved.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(saved[name], tensor), name
    for name, tensor in reference10.items():
        torch.testing.assert_close(saved[f"model/{name}"], tensor, atol=1e-5, rtol=1e-4)
    evs = events(tmp_path / "run")
    (failed,) = of(evs, "final_save_failed")
    assert failed["step"] == 10 and failed["newest_step"] == 5
    assert of(evs, "run_end")[0]["status"] == "ok"  # closed by the caller, after the save
    resumed = fit(mlp.make_spec(n=N), steps=12, replicas=2, run_dir=tmp_path / "again",
                  checkpoint=CheckpointConfig(root=str(tmp_path / "elsewhere"), every=100))
    assert resumed.final_step == 12
    (restore,) = of(events(tmp_path / "again"), "restore")
    assert restore["step"] == 10 and restore["path"] == path


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_the_command_line_saves_the_final_state_at_its_fallback(tmp_path, capsys):
    from planaria.cli.main import main

    examples = Path(__file__).resolve().parents[2] / "src" / "planaria" / "examples"
    with tmpfs(tmp_path / "root", "400k") as root:
        base = ["run", f"{examples / 'mlp.py'}:spec", "--replicas", "2", "--steps", "10",
                "--quiet", "--run-dir", str(tmp_path / "run"), "--checkpoint-every", "5",
                "--checkpoint-root", str(root)]
        assert main([*base, "--final-save-fallback", str(tmp_path / "fallback")]) == 0
        err = capsys.readouterr().err
        assert "the final checkpoint (step 10) could not be written" in err
        assert f"saved at {tmp_path / 'fallback' / 'step_000000010'}" in err
        assert f"--checkpoint-root {tmp_path / 'fallback'}" in err
        steps = [c.step for c in list_checkpoints(str(tmp_path / "fallback")) if c.committed]
        assert steps == [10]


@pytest.mark.multiprocess
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("on_failing", [pytest.param("warn", marks=pytest.mark.extended), "stop"])
def test_a_checkpoint_root_that_fills_is_escalated_and_leaves_no_partial_file(tmp_path,
                                                                              on_failing):
    # ~250 KB a save: two fit in 640 KB, the rest fail with ENOSPC part-way.
    with tmpfs(tmp_path / "ckpt", "640k") as root:
        config = CheckpointConfig(root=str(root), every=2, keep_last=5, fsync=False,
                                  max_failed_saves=3, on_failing=on_failing)
        run = tmp_path / "run"
        spec = mlp.make_spec(n=N)
        if on_failing == "stop":
            with pytest.raises(CheckpointError, match="3 checkpoints in a row were not "
                               r"committed.*newest committed one is step 4"):
                fit(spec, steps=20, replicas=2, run_dir=run, checkpoint=config)
        else:
            with pytest.raises(FinalSaveFailed) as err:
                fit(spec, steps=20, replicas=2, run_dir=run, checkpoint=config)
            err.value.job.close()
        evs = events(run)
        failing = of(evs, "checkpoints_failing")
        assert failing and failing[0]["failed"] == 3 and failing[0]["newest_step"] == 4
        assert failing[0]["action"] == on_failing
        assert [c.step for c in list_checkpoints(str(root)) if c.committed] == [2, 4]
        # Nothing a failed save wrote stays: no temporary directory, no partial shard.
        leftovers = [p.name for p in root.iterdir() if ".tmp-" in p.name]
        assert leftovers == [], leftovers
