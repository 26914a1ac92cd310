"""A run dir used again: a finished job says so and starts nothing, a run that does not
resume is refused beside old checkpoints before anything starts (all without Ray here);
the end-to-end runs are in tests/cli/test_cli.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from planaria.checkpoint import (
    commit_checkpoint,
    new_save_id,
    plan_shards,
    take_share,
    write_shard,
)
from planaria.checkpoint.config import CheckpointConfig
from planaria.cli.main import main
from planaria.control.run_record import finished_job

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "planaria" / "examples"
CKPT_RUN = "ckptrun0"


def _commit(root: Path, step: int, run_id: str = CKPT_RUN) -> str:
    state = {"model/w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    plans = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, 1)
    sid = new_save_id()
    records = [write_shard(str(root), step, p.index, 1, take_share(state, p), save_id=sid)
               for p in plans]
    return commit_checkpoint(str(root), step, records, {"step": step}, world_size=1,
                             run_id=run_id)


def _log(run_dir: Path, *records: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "events.jsonl").open("a") as f:
        for t, r in enumerate(records):
            f.write(json.dumps({"t": 1000.0 + t, **r}) + "\n")


def _finished_run(run_dir: Path, *, steps: int = 4, status: str = "ok",
                  saved: int | None = 4) -> None:
    """What a run of ``steps`` steps leaves: its log, and its final checkpoint."""
    _log(run_dir,
         {"event": "run_start", "run_id": "job1", "resume": True, "steps": steps},
         {"event": "checkpoint_lineage", "run_id": CKPT_RUN, "lineage": [CKPT_RUN],
          "mode": "resume"},
         {"event": "step_committed", "step": steps - 1, "loss": 0.5},
         {"event": "run_end", "status": status, "step": steps})
    if saved is not None:
        _commit(run_dir / "checkpoints", saved)


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's start and fit fail the test: the command must answer before either."""
    import importlib

    import ray

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Ray or the job was started")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(importlib.import_module("planaria.fit"), "fit", refuse)


def _run(run_dir: Path, *options: str) -> list[str]:
    return ["run", f"{EXAMPLES / 'mlp.py'}:spec", "--replicas", "2", "--quiet",
            "--run-dir", str(run_dir), *options]


@pytest.mark.usefixtures("nothing_starts")
def test_a_finished_job_run_again_says_so_and_starts_nothing(tmp_path, capsys):
    _finished_run(tmp_path)
    t0 = time.monotonic()
    assert main(_run(tmp_path, "--steps", "4")) == 0
    took = time.monotonic() - t0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"run dir {tmp_path}: the job finished at step 4 (run job1;")
    assert "give more --steps" in line and "a new --run-dir" in line
    assert took < 10  # no Ray, no worker: the log and a listing (a loaded machine)
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(lines) == 4  # nothing written: no new run started


def test_what_is_not_finished(tmp_path):
    """More steps, a last run that failed, a final save that did not commit, no resume,
    no checkpoints, a resumed lineage that is not this root's: each resumes (or starts)."""
    ckpt = CheckpointConfig(every=2)
    done = tmp_path / "done"
    _finished_run(done)
    found = finished_job(done, 4, ckpt)
    assert found is not None and found.step == 4 and found.run_id == "job1"
    assert found.checkpoint.endswith("step_000000004")
    assert finished_job(done, 3, ckpt) is not None  # fewer steps asked than trained
    assert finished_job(done, 5, ckpt) is None
    assert finished_job(done, 4, CheckpointConfig(every=2, resume=False)) is None
    assert finished_job(done, 4, None) is None
    assert finished_job(done, 4, CheckpointConfig(root=str(tmp_path / "elsewhere"))) is None
    failed = tmp_path / "failed"
    _finished_run(failed, status="error")
    assert finished_job(failed, 4, ckpt) is None
    unsaved = tmp_path / "unsaved"
    _finished_run(unsaved, saved=2)
    assert finished_job(unsaved, 4, ckpt) is None
    crashed = tmp_path / "crashed"  # a later run that died without its run_end
    _finished_run(crashed)
    _log(crashed, {"event": "run_start", "run_id": "job2", "resume": True, "steps": 6})
    assert finished_job(crashed, 4, ckpt) is None
    other = tmp_path / "other"
    _finished_run(other, saved=None)
    _commit(other / "checkpoints", 4, run_id="someone-else")
    assert finished_job(other, 4, ckpt) is None


@pytest.mark.usefixtures("nothing_starts")
def test_no_resume_beside_old_checkpoints_is_refused_before_anything_starts(tmp_path, capsys):
    _finished_run(tmp_path)
    assert main(_run(tmp_path, "--steps", "4", "--no-resume")) == 1
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith(f"planaria: checkpoint root {tmp_path.resolve() / 'checkpoints'} "
                           "holds 1 checkpoints of other runs")
    assert f"run {CKPT_RUN}: steps 4" in line and "--checkpoint-on-other-run overwrite" in line
    assert "Traceback" not in captured.err + captured.out


@pytest.mark.usefixtures("nothing_starts")
def test_a_missing_checkpoint_root_is_neither_finished_nor_refused(tmp_path, capsys):
    """A fresh run dir goes on to start the job (here: fit, which the fixture refuses)."""
    with pytest.raises(AssertionError, match="was started"):
        main(_run(tmp_path / "fresh", "--steps", "4", "--no-resume"))
    with pytest.raises(AssertionError, match="was started"):
        main(_run(tmp_path / "fresh2", "--steps", "4"))
