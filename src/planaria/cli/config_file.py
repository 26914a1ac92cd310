"""``planaria run|demo --config job.toml --set key=value``: a job's options from a file.

A config file holds what the flags say, by the flags' names (``replicas = 2``,
``checkpoint-every = 100`` or ``checkpoint_every = 100``), a ``[checkpoint]`` table for the
``--checkpoint-*`` flags (``every``, ``root``, ``storage_options`` as a table,
``on_other_run``), ``target = "train.py:make_spec"`` for the script and ``[spec_args]``, the
keyword arguments of a spec *factory* (a function returning the TrainSpec). TOML or YAML,
by the file's extension. ``--set a.b=value`` overrides a key (``value`` read as TOML: ``4``,
``true``, ``"text"``, else taken as text). Flags given on the command line win over both. The
resolved options are written to ``RUN_DIR/config.json`` and shown by ``planaria report``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from planaria.faults.errors import ConfigError

__all__ = ["CONFIG_FILE", "file_values", "resolved", "write_resolved"]

CONFIG_FILE = "config.json"
"""The resolved options of a run, in its run dir."""

_TABLES = {"checkpoint": "checkpoint_"}
"""Tables whose keys are flags with a prefix: ``[checkpoint] every`` is ``--checkpoint-every``."""
_FREE = {"spec_args"}
"""Tables passed on as they are (a spec factory's keyword arguments)."""


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"--config {path}: the file does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            return tomllib.loads(text)
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
            if not isinstance(data, dict):
                raise ConfigError(f"--config {path}: a YAML mapping of options is expected, "
                                  f"not a {type(data).__name__}")
            return data
    except (tomllib.TOMLDecodeError, ValueError) as err:
        raise ConfigError(f"--config {path} could not be read: {err}") from None
    raise ConfigError(f"--config {path}: a .toml, .yaml or .yml file is expected")


def _value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _with_overrides(data: dict[str, Any], sets: Sequence[str]) -> dict[str, Any]:
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} is not valid: KEY=VALUE, e.g. replicas=4 or "
                              "checkpoint.every=100")
        *tables, last = key.strip().split(".")
        where = data
        for table in tables:
            where = where.setdefault(table, {})
            if not isinstance(where, dict):
                raise ConfigError(f"--set {item!r}: {table} is not a table")
        where[last] = _value(text.strip())
    return data


def _dest(key: str) -> str:
    return key.strip().replace("-", "_")


def file_values(config: str | None, sets: Sequence[str],
                parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The options a config file and ``--set`` give, as ``parser``'s destinations; a key no
    flag of ``parser`` has is a :class:`ConfigError` naming it (and the likely one meant)."""
    data = _load(Path(config)) if config else {}
    data = _with_overrides(data, sets)
    known = {a.dest: a for a in parser._actions if a.dest not in ("help", "config", "set")}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = _dest(key)
        if name in _FREE:
            if not isinstance(value, dict):
                raise ConfigError(f"{key} is not valid: a table of keyword arguments")
            out[name] = dict(value)
            continue
        if name in _TABLES and isinstance(value, dict):
            for sub, inner in value.items():
                flat = _TABLES[name] + _dest(sub)
                if flat == "checkpoint_storage_options":
                    flat, inner = "checkpoint_storage_option", [
                        f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                        for k, v in inner.items()]
                dest = _known(flat, f"{key}.{sub}", known)
                out[dest] = _as_flag(known[dest], inner, f"{key}.{sub}")
            continue
        dest = _known(name, key, known)
        out[dest] = _as_flag(known[dest], value, key)
    return out


def _as_flag(action: argparse.Action, value: Any, key: str) -> Any:
    """``value`` as the flag would have parsed it (its type, its choices)."""
    if value is None or isinstance(value, (bool, list, dict)):
        return value  # a table (runtime_env) is checked by the option's own parser
    text = value if isinstance(value, str) else str(value)
    try:
        parsed = action.type(text) if callable(action.type) else text
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r} is not valid: {action.help or action.dest}") from None
    if action.choices is not None and parsed not in action.choices:
        raise ConfigError(f"{key}={value!r} is not valid: one of "
                          f"{', '.join(map(str, action.choices))}")
    return parsed


def _known(name: str, key: str, known: Mapping[str, Any]) -> str:
    if name not in known:
        close = difflib.get_close_matches(name, list(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"{key} is not an option of this command{hint} (the options are "
                          f"the flags' names: {', '.join(sorted(known))})")
    return name


def resolved(args: argparse.Namespace) -> dict[str, Any]:
    """The options a run was started with, after file, ``--set`` and flags (JSON-able)."""
    skip = {"config", "set", "verbose", "command"}
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())
            if k not in skip}


def write_resolved(args: argparse.Namespace, run_dir: Path) -> Path:
    """Writes :func:`resolved` to ``RUN_DIR/config.json``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    path.write_text(json.dumps(resolved(args), indent=2, default=str) + "\n")
    return path
