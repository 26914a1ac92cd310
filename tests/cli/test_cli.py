"""The command line, end to end: a real run with a chaos kill, then its report."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from planaria.cli.main import main
from planaria.observe.events import read_events

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "planaria" / "examples"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_run_with_chaos_kill_then_report_agrees_with_events(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(
        [
            "run",
            f"{EXAMPLES / 'mlp.py'}:spec",
            "--replicas",
            "3",
            "--steps",
            "40",
            "--run-dir",
            str(run_dir),
            "--chaos",
            "kill:w1@step10",
            "--ledger",
            "--no-resume",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "w1 lost" in out and "done: 40 steps" in out

    events = read_events(run_dir).events
    recovered = next(e for e in events if e["event"] == "recovered")
    detected = next(e for e in events if e["event"] == "detected")

    png = tmp_path / "timeline.png"
    assert main(["report", str(run_dir), "--json", "--png", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"]["committed"] == 40 and report["steps"]["failed"] == 1
    (fault,) = report["faults"]
    assert fault["kind"] == "worker_lost" and fault["worker"] == "w1"
    assert fault["recover_s"] == pytest.approx(recovered["recover_s"])
    assert fault["detect_s"] == pytest.approx(detected["detect_s"])
    assert fault["lost_steps"] == 0
    assert 0 < report["goodput"] < 1 and 0 < report["replica_efficiency"] <= 1
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 400 and height > 300

    assert main(["report", str(run_dir)]) == 0  # the terminal tables
    text = capsys.readouterr().out
    assert "worker_lost" in text and "goodput" in text


def test_run_names_a_missing_script_and_a_missing_spec(tmp_path, capsys):
    options = ["--replicas", "1", "--steps", "1", "--run-dir", str(tmp_path)]
    assert main(["run", str(tmp_path / "nope.py"), *options]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["run", f"{EXAMPLES / 'mlp.py'}:nothing", *options]) == 2
    err = capsys.readouterr().err
    assert "no TrainSpec named 'nothing'" in err and ":spec" in err


def test_report_without_a_log_says_so(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) != 0


_CACHED_SCRIPT = '''
from functools import lru_cache

import torch

from planaria import TrainSpec


@lru_cache(maxsize=1)
def table() -> torch.Tensor:  # cloudpickle sends this by reference, never by value
    return torch.arange(8.0)


class Data:
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return table()[i : i + 1]


spec = TrainSpec(model=lambda: torch.nn.Linear(1, 1),
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                 loss=lambda m, b: m(b).pow(2).mean(), dataset=Data,
                 global_batch_size=4, micro_batch_size=2)
'''


def test_a_script_s_spec_reaches_a_process_that_only_has_its_folder(tmp_path):
    """`planaria run SCRIPT.py`: the spec travels pickled, partly by reference (a function
    under lru_cache cannot go by value); a worker, with the script's folder on its path, can
    load it (before, the script was imported under a made-up name no worker could import)."""
    import subprocess
    import sys

    import ray.cloudpickle

    from planaria.cli.main import load_spec

    script = tmp_path / "cached_table_spec.py"
    script.write_text(_CACHED_SCRIPT)
    blob = tmp_path / "spec.pkl"
    blob.write_bytes(ray.cloudpickle.dumps(load_spec(str(script))))
    code = ("import sys, ray.cloudpickle as cp; spec = cp.loads(open(sys.argv[1], 'rb').read()); "
            "print(float(spec.dataset()[3][0]))")
    out = subprocess.run([sys.executable, "-c", code, str(blob)], capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
                         check=True, timeout=120)
    assert out.stdout.strip() == "3.0"


def test_a_url_run_dir_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """`--run-dir s3://bucket/run` would be the local folder ./s3:/bucket/run (checkpoints
    included, lost with the machine): refused, naming the checkpoint root option."""
    from planaria import RunConfig, fit
    from planaria.examples import mlp
    from planaria.faults.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    code = main(["run", f"{EXAMPLES / 'mlp.py'}:spec", "--replicas", "1", "--steps", "1",
                 "--run-dir", "s3://bucket/run"])
    err = capsys.readouterr().err
    assert code == 2 and "--checkpoint-root" in err and "s3://bucket/run" in err
    with pytest.raises(ConfigError, match="CheckpointConfig\\(root="):
        RunConfig(steps=1, replicas=1, run_dir=Path("s3://bucket/run"))
    with pytest.raises(ConfigError, match="not a URL"):
        fit(mlp.make_spec(n=64), steps=1, replicas=1, run_dir="gs://bucket/run")
    assert list(tmp_path.iterdir()) == []  # no ./s3: or ./gs: folder


def test_checkpoint_options_on_the_command_line(tmp_path):
    """Checkpoints by default (auto), none on request; the first line says where they go."""
    from planaria.cli.main import _parser
    from planaria.cli.run_dir import checkpoint_config as _checkpoint_config
    from planaria.cli.run_dir import checkpoint_line as _checkpoint_line
    from planaria.faults.errors import ConfigError

    def config(*options: str):
        args = _parser().parse_args(["run", "x.py", "--replicas", "1", "--steps", "1",
                                     "--run-dir", str(tmp_path), *options])
        return _checkpoint_config(args)

    default = config()
    assert default.every == "auto" and default.resume and default.root is None
    assert _checkpoint_line(default, tmp_path) == (
        f"checkpoints: every auto under {tmp_path / 'checkpoints'} (resumes from the newest "
        "there; --checkpoint-every none saves none)")
    off = config("--checkpoint-every", "none")
    assert off.every is None and off.resume  # resumes from what is there, saves nothing
    assert "none saved" in _checkpoint_line(off, tmp_path)
    assert config("--checkpoint-every", "none", "--no-resume") is None
    assert "retrains from step 0" in _checkpoint_line(None, tmp_path)
    s3 = config("--checkpoint-root", "s3://b/run", "--checkpoint-storage-option",
                "endpoint_url=http://127.0.0.1:9000", "--checkpoint-storage-option",
                "use_ssl=false")
    assert s3.root == "s3://b/run"
    assert s3.storage_options == {"endpoint_url": "http://127.0.0.1:9000", "use_ssl": False}
    assert "under s3://b/run" in _checkpoint_line(s3, tmp_path)
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        config("--checkpoint-storage-option", "endpoint_url")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_default_run_checkpoints_and_a_second_run_resumes(tmp_path, capsys):
    """`planaria run` with no checkpoint option saves (the final state at least) and says
    where first; the same command run again after the process is gone resumes there."""
    from planaria.checkpoint import list_checkpoints

    run_dir = tmp_path / "run"
    base = ["run", f"{EXAMPLES / 'mlp.py'}:spec", "--replicas", "2", "--run-dir",
            str(run_dir), "--quiet"]
    assert main([*base, "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(
        f"checkpoints: every auto under {run_dir.resolve() / 'checkpoints'}")
    steps = [c.step for c in list_checkpoints(str(run_dir / "checkpoints")) if c.committed]
    assert steps == [4]
    assert main([*base, "--steps", "4"]) == 0  # finished: says so, starts nothing
    assert "the job finished at step 4" in capsys.readouterr().out
    assert main([*base, "--steps", "6"]) == 0
    (restore,) = [e for e in read_events(run_dir).events if e["event"] == "restore"]
    assert restore["step"] == 4 and restore["reason"] == "resume"
    steps = [c.step for c in list_checkpoints(str(run_dir / "checkpoints")) if c.committed]
    assert steps == [4, 6]
    capsys.readouterr()
    # --no-resume beside them: refused (before Ray: see tests/cli/test_run_dirs.py), then
    # overwritten on request; that run is a new run of the run dir, reported alone.
    assert main([*base, "--steps", "2", "--no-resume"]) == 1
    assert "--checkpoint-on-other-run overwrite" in capsys.readouterr().err
    assert main([*base, "--steps", "2", "--no-resume", "--checkpoint-on-other-run",
                 "overwrite"]) == 0
    steps = [c.step for c in list_checkpoints(str(run_dir / "checkpoints")) if c.committed]
    assert steps == [2]
    capsys.readouterr()
    assert main(["report", str(run_dir), "--json"]) == 0
    latest = json.loads(capsys.readouterr().out)
    assert latest["steps"]["committed"] == 2 and latest["segments"] == 1
    assert len(latest["runs"]) == 2
    assert main(["report", str(run_dir), "--json", "--run", latest["runs"][0]]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["steps"]["committed"] == 6 and first["segments"] == 2
    assert main(["report", str(run_dir), "--all"]) == 0
    assert "2 runs" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_checkpoints_on_s3_from_the_command_line_and_a_resume_from_there(
        tmp_path, capsys, s3_options):
    """`--checkpoint-root s3://...` with the endpoint and keys as storage options: the run's
    checkpoints are in the bucket (none in the run dir, which keeps the event log), `ckpt ls`
    lists them, the same command says the job finished, with more steps resumes from the
    bucket, and a run with another local run dir resumes from them."""
    from planaria.checkpoint import list_checkpoints

    root = "s3://planaria-ckpt/cli-run"
    options = [f"--checkpoint-storage-option={k}={v}" for k, v in s3_options.items()]
    base = ["run", f"{EXAMPLES / 'mlp.py'}:spec", "--replicas", "2", "--quiet",
            "--checkpoint-every", "3", "--checkpoint-root", root, *options]
    assert main([*base, "--steps", "6", "--run-dir", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(
        f"checkpoints: every 3 steps under {root}")
    assert not (tmp_path / "a" / "checkpoints").exists()
    assert not list((tmp_path / "a").rglob("step_*"))
    assert (tmp_path / "a" / "events.jsonl").exists()
    committed = [c.step for c in list_checkpoints(root, storage_options=s3_options)
                 if c.committed]
    assert committed == [3, 6]
    assert main(["ckpt", "ls", root, "--json",
                 *(f"--storage-option={k}={v}" for k, v in s3_options.items())]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["committed"], r["verified"]) for r in rows] == [
        (3, True, True), (6, True, True)]
    assert main([*base, "--steps", "6", "--run-dir", str(tmp_path / "a")]) == 0
    assert "the job finished at step 6" in capsys.readouterr().out  # read from the bucket
    assert main([*base, "--steps", "7", "--run-dir", str(tmp_path / "a")]) == 0
    (restore,) = [e for e in read_events(tmp_path / "a").events if e["event"] == "restore"]
    assert restore["step"] == 6 and restore["path"] == f"{root}/step_000000006"
    assert not list((tmp_path / "a").rglob("step_*"))
    assert main([*base, "--steps", "8", "--run-dir", str(tmp_path / "b")]) == 0
    (restore,) = [e for e in read_events(tmp_path / "b").events if e["event"] == "restore"]
    assert restore["step"] == 7 and restore["path"] == f"{root}/step_000000007"
    committed = [c.step for c in list_checkpoints(root, storage_options=s3_options)
                 if c.committed]
    assert committed[-1] == 8
    assert [e["step"] for e in read_events(tmp_path / "b").events
            if e["event"] == "run_end"] == [8]
