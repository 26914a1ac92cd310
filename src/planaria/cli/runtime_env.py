"""``planaria run --runtime-env``: Ray's ``runtime_env`` for the job, so that the user's code
(``{"working_dir": "."}``), packages (``pip``) or environment variables reach the workers
of a cluster the controller joins with ``--address``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planaria.faults.errors import ConfigError

__all__ = ["ray_init_options", "runtime_env"]

_FIX = ("give a JSON object such as '{\"working_dir\": \".\"}', or a .json, .yaml or .yml "
        "file holding one")


def runtime_env(value: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """The runtime_env ``value`` names: JSON text, a JSON or YAML file, or (from a config
    file's ``[runtime_env]`` table) a mapping already; None for None. Anything else is a
    :class:`ConfigError` that names the problem and the fix."""
    if value is None or isinstance(value, dict):
        return value
    text = value.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as err:
            raise ConfigError(f"--runtime-env {value!r} is not valid JSON ({err}): "
                              f"{_FIX}") from None
    else:
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"--runtime-env {value}: no such file; {_FIX}")
        if path.suffix not in (".json", ".yaml", ".yml"):
            raise ConfigError(f"--runtime-env {value}: not a .json, .yaml or .yml file; {_FIX}")
        import yaml

        try:
            if path.suffix == ".json":
                data = json.loads(path.read_text())
            else:
                data = yaml.safe_load(path.read_text())
        except (ValueError, yaml.YAMLError) as err:
            raise ConfigError(f"--runtime-env {value} could not be read ({err}): "
                              f"{_FIX}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--runtime-env {value!r}: a mapping of runtime_env keys is "
                          f"expected, not a {type(data).__name__}; {_FIX}")
    return data


def ray_init_options(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """``RunConfig.ray_init_kwargs`` for ``--runtime-env value`` (none without one)."""
    env = runtime_env(value)
    return {} if env is None else {"runtime_env": env}
