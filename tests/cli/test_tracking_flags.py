"""The watching flags: ``--log-to`` checked before a run starts, ``--metrics-host``."""

from __future__ import annotations

import argparse
import urllib.request
from pathlib import Path

from planaria.cli.main import main
from planaria.cli.tracking import add_tracking_flags, metrics_exporter, tracker_options

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "planaria" / "examples"


def test_an_unknown_tracker_is_refused_before_the_run(tmp_path, capsys):
    options = ["--replicas", "1", "--steps", "1", "--run-dir", str(tmp_path / "run")]
    assert main(["run", f"{EXAMPLES / 'mlp.py'}:spec", *options, "--log-to", "csv,neptune"]) == 2
    err = capsys.readouterr().err
    assert "--log-to" in err and "neptune" in err and "tensorboard" in err
    assert not (tmp_path / "run" / "events.jsonl").exists()


def test_tracker_options_and_the_exporters_host(tmp_path):
    parser = argparse.ArgumentParser()
    add_tracking_flags(parser)
    args = parser.parse_args(["--log-to", "csv", "--log-dir", str(tmp_path), "--wandb-mode",
                              "offline", "--metrics-port", "0", "--metrics-host", "127.0.0.3"])
    options = tracker_options(args, tmp_path / "run-7")
    assert options.log_dir == tmp_path and options.run_name == "run-7"
    assert options.wandb_mode == "offline"
    exporter = metrics_exporter(args, "mlp")
    try:
        exporter({"t": 0.0, "event": "run_start", "run_id": "abc", "replicas": 1})
        url = f"http://127.0.0.3:{exporter.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert 'job="mlp",run_id="abc"' in resp.read().decode()
    finally:
        exporter.close()
    defaults = parser.parse_args([])
    assert defaults.metrics_host == "127.0.0.1" and defaults.log_to == ""
    assert metrics_exporter(defaults, "mlp") is None
