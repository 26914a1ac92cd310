"""The command line, end to end: a real run with a chaos kill, then its report."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from planaria.cli import main
from planaria.events import read_events

EXAMPLES = Path(__file__).resolve().parents[1] / "src" / "planaria" / "examples"


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

    from planaria.cli import load_spec

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
