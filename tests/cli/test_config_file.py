"""``--config job.toml|yaml`` with ``--set`` overrides: the same options as the flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planaria.cli.main import _parse, main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

TOML = """
target = "{script}:make_spec"
replicas = 3
steps = 10
run-dir = "{run_dir}"
ledger = true
on_worker_lost = "pause"

[checkpoint]
every = 5
root = "{run_dir}/ck"
storage_options = {{ anon = true }}

[spec_args]
n = 512
"""

YAML = """
target: "{script}:make_spec"
replicas: 3
steps: 10
run_dir: "{run_dir}"
ledger: true
on-worker-lost: pause
checkpoint:
  every: 5
  root: "{run_dir}/ck"
  storage_options: {{anon: true}}
spec_args:
  n: 512
"""


def flags(run_dir: Path) -> list[str]:
    return ["run", f"{EXAMPLES / 'mlp.py'}:make_spec", "--replicas", "4", "--steps", "10",
            "--run-dir", str(run_dir), "--ledger", "--on-worker-lost", "pause",
            "--checkpoint-every", "5", "--checkpoint-root", f"{run_dir}/ck",
            "--checkpoint-storage-option", "anon=true"]


@pytest.mark.parametrize("kind,text", [("toml", TOML), ("yaml", YAML)])
def test_a_config_file_with_overrides_gives_the_flags_options(tmp_path, kind, text):
    path = tmp_path / f"job.{kind}"
    path.write_text(text.format(script=EXAMPLES / "mlp.py", run_dir=tmp_path / "run"))
    from_file = vars(_parse(["run", "--config", str(path), "--set", "replicas=4",
                             "--set", "spec_args.n=256"]))
    from_flags = vars(_parse(flags(tmp_path / "run")))
    assert from_file.pop("spec_args") == {"n": 256}
    for d in (from_file, from_flags):
        d.pop("config"), d.pop("set")
    assert from_file == from_flags


def test_a_flag_given_wins_over_the_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(TOML.format(script=EXAMPLES / "mlp.py", run_dir=tmp_path / "run"))
    args = _parse(["run", "--config", str(path), "--steps", "7"])
    assert (args.steps, args.replicas) == (7, 3)


def test_a_key_no_flag_has_is_named_with_the_likely_one(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text('replica = 3\nsteps = 2\nrun_dir = "x"\ntarget = "a.py"\n')
    with pytest.raises(SystemExit) as stopped:
        _parse(["run", "--config", str(path)])
    assert stopped.value.code == 2
    assert "replica is not an option" in capsys.readouterr().err


def test_what_is_missing_is_named(capsys):
    with pytest.raises(SystemExit):
        _parse(["run", "--steps", "3"])
    err = capsys.readouterr().err
    assert "--replicas" in err and "--run-dir" in err and "SCRIPT.py" in err


def test_spec_args_meet_a_spec_that_is_no_function(tmp_path, capsys):
    code = main(["run", f"{EXAMPLES / 'mlp.py'}:spec", "--replicas", "1", "--steps", "1",
                 "--run-dir", str(tmp_path), "--set", "spec_args.n=3"])
    assert code == 2 and "not a function that builds one" in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_run_from_a_config_file_records_what_it_resolved(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(TOML.format(script=EXAMPLES / "mlp.py", run_dir=tmp_path / "run")
                    .replace("replicas = 3", "replicas = 1").replace("steps = 10", "steps = 2")
                    .replace('storage_options = { anon = true }', ""))
    assert main(["run", "--config", str(path), "--set", "spec_args.n=256", "--quiet"]) == 0
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (resolved["replicas"], resolved["steps"], resolved["spec_args"]) == (1, 2, {"n": 256})
    assert resolved["checkpoint_every"] == "5" and resolved["ledger"] is True
