"""``planaria run --runtime-env``: what it accepts, and errors that name the problem and the fix."""

from __future__ import annotations

import pytest

from planaria.cli.runtime_env import ray_init_options, runtime_env
from planaria.faults.errors import ConfigError


def test_json_text_a_file_or_a_table_give_the_runtime_env(tmp_path):
    assert runtime_env('{"working_dir": "."}') == {"working_dir": "."}
    (tmp_path / "env.yaml").write_text("working_dir: .\nenv_vars:\n  A: '1'\n")
    assert runtime_env(str(tmp_path / "env.yaml")) == {"working_dir": ".", "env_vars": {"A": "1"}}
    (tmp_path / "env.json").write_text('{"pip": ["einops"]}')
    assert runtime_env(str(tmp_path / "env.json")) == {"pip": ["einops"]}
    assert runtime_env({"working_dir": "."}) == {"working_dir": "."}
    assert ray_init_options(None) == {}
    assert ray_init_options('{"working_dir": "."}') == {"runtime_env": {"working_dir": "."}}


@pytest.mark.parametrize(("value", "says"), [
    ('{"working_dir": ', "is not valid JSON"),
    ("no/such/env.yaml", "no such file"),
    ("[1, 2]", "no such file"),
])
def test_bad_values_name_the_problem_and_the_fix(value, says):
    with pytest.raises(ConfigError, match=says) as err:
        runtime_env(value)
    assert "working_dir" in str(err.value)  # the fix: an example of what is expected


def test_a_file_that_is_not_a_mapping_is_refused(tmp_path):
    (tmp_path / "env.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="a mapping of runtime_env keys is expected"):
        runtime_env(str(tmp_path / "env.yaml"))
    (tmp_path / "env.txt").write_text("{}")
    with pytest.raises(ConfigError, match=r"not a \.json, \.yaml or \.yml file"):
        runtime_env(str(tmp_path / "env.txt"))


def test_a_config_file_table_reaches_the_run(tmp_path):
    import argparse

    from planaria.cli.config_file import file_values

    parser = argparse.ArgumentParser()
    parser.add_argument("--runtime-env", default=None)
    (tmp_path / "job.toml").write_text('[runtime_env]\nworking_dir = "."\n')
    values = file_values(str(tmp_path / "job.toml"), [], parser)
    assert ray_init_options(values["runtime_env"]) == {"runtime_env": {"working_dir": "."}}
