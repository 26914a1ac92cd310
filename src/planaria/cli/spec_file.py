"""A user's training script as a TrainSpec: ``SCRIPT.py[:NAME]`` (the command line's
``planaria run`` and the fault campaign's ``--spec`` take the same)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["load_spec"]


def _importable(name: str) -> bool:
    try:
        return name in sys.modules or importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return True


def load_spec(target: str, spec_args: dict[str, Any] | None = None) -> Any:
    """Loads ``SCRIPT.py[:NAME]`` and returns its TrainSpec (named ``spec`` by default), or
    what its function ``NAME`` returns, called with ``spec_args`` as keyword arguments.

    The script is imported as a module whose code travels to the workers by
    value, and its folder goes on the workers' PYTHONPATH so that it can import
    its neighbours.
    """
    from planaria.config import TrainSpec
    from planaria.faults.errors import ConfigError

    path_text, _, name = target.partition(":")
    name = name or "spec"
    path = Path(path_text)
    if not path.is_file():
        raise ConfigError(f"script {path_text!r} does not exist: give SCRIPT.py[:SPEC_NAME]")
    # Its own name where that imports nothing else, so that the workers (which get its folder
    # on their PYTHONPATH) can import it: what cloudpickle cannot send by value (a function
    # under functools.lru_cache) is sent by reference. A name taken is prefixed instead.
    module_name = path.stem
    if not module_name.isidentifier() or _importable(module_name):
        module_name = f"planaria_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import {path}: is it a Python file?")
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (folder, os.environ.get("PYTHONPATH", "")) if p
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(module)
    value = getattr(module, name, None)
    if callable(value) and not isinstance(value, TrainSpec):
        try:
            value = value(**(spec_args or {}))
        except TypeError as err:
            raise ConfigError(f"{path_text}:{name}({', '.join(spec_args or {})}) could not be "
                              f"called: {err}; give its arguments in [spec_args] (--config) or "
                              "--set spec_args.NAME=VALUE") from None
        if not isinstance(value, TrainSpec):
            raise ConfigError(f"{path_text}:{name}(...) returned a {type(value).__name__}, "
                              "not a TrainSpec")
        return value
    if spec_args:
        raise ConfigError(f"spec_args={spec_args!r} is not valid: {path_text}:{name} is a "
                          "TrainSpec, not a function that builds one")
    if not isinstance(value, TrainSpec):
        found = [k for k, v in vars(module).items() if isinstance(v, TrainSpec)]
        raise ConfigError(
            f"{path} has no TrainSpec named {name!r}"
            + (f"; it has {', '.join(found)}: use {path_text}:{found[0]}" if found else "")
        )
    return value
