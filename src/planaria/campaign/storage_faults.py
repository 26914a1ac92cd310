"""``faulty://``: local files through fsspec, with one-shot storage errors on demand.

A checkpoint root ``faulty:///abs/path`` stores real files under ``/abs/path``
but goes through fsspec's generic (non-POSIX) path of
:class:`~planaria.checkpoint.storage.Storage`, so every open is seen here. The
campaign arms an error by creating ``CONTROL/arm-write-<seq>.json`` or
``CONTROL/arm-read-<seq>.json`` (``control`` is a storage option, so every
process that opens the root sees the same directory); the next open for that
kind of access, in whichever process comes first, takes the oldest armed file
it matches (an atomic rename), logs it to ``CONTROL/fired.jsonl`` and raises
``OSError(EIO)``. Errors armed one after the other wait their turn: a second
arming never replaces a first that has not fired.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

__all__ = ["PROTOCOL", "FaultyFileSystem", "arm", "armed", "fired", "log_fired"]

PROTOCOL = "faulty"
FIRED_LOG = "fired.jsonl"


def arm(
    control: str | Path, op: str, *, fault_id: str, match: str = "", skip_pid: int | None = None
) -> None:
    """Makes the next ``op`` ("read" or "write") on a faulty:// root whose path contains
    ``match``, in any process but ``skip_pid``, fail once."""
    if op not in ("read", "write"):
        raise ValueError(f"op={op!r} is not valid: 'read' or 'write'")
    control = Path(control)
    tmp = control / f".tmp-arm-{os.getpid()}-{time.monotonic_ns()}"
    tmp.write_text(json.dumps({"id": fault_id, "match": match, "skip_pid": skip_pid}))
    os.replace(tmp, control / f"arm-{op}-{time.time_ns():020d}.json")  # its order: the name


def log_fired(control: str | Path, record: dict[str, Any]) -> None:
    """Appends one record to ``CONTROL/fired.jsonl``, durably (the process may die next)."""
    line = json.dumps({**record, "t": time.time(), "pid": os.getpid()}) + "\n"
    fd = os.open(Path(control) / FIRED_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (none if it is missing; a line torn by a SIGKILL
    mid-write is left out)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def fired(control: str | Path) -> list[dict[str, Any]]:
    """Every injection that fired (storage errors and the loss triggers)."""
    return read_jsonl(Path(control) / FIRED_LOG)


def armed(control: str | Path, op: str) -> list[str]:
    """The errors armed for ``op`` and not fired yet, oldest first (their fault ids)."""
    out = []
    for name in _armed_files(str(control), op):
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            out.append(json.loads(Path(control, name).read_text()).get("id"))
    return out


def _armed_files(control: str, op: str) -> list[str]:
    try:
        names = os.listdir(control)
    except FileNotFoundError:
        return []
    prefix = f"arm-{op}-"
    return sorted(n for n in names if n.startswith(prefix) and n.endswith(".json"))


def _take(control: str, op: str, path: str) -> None:
    for name in _armed_files(control, op):
        armed_file = os.path.join(control, name)
        try:
            with open(armed_file) as f:
                armed_for = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        if armed_for.get("match", "") not in path or armed_for.get("skip_pid") == os.getpid():
            continue
        taken = os.path.join(control, f"taken-{name}.{os.getpid()}.{time.monotonic_ns()}")
        try:
            os.rename(armed_file, taken)  # atomic: one opener in one process wins
        except FileNotFoundError:
            continue
        log_fired(control, {"id": armed_for.get("id"), "action": f"storage_{op}", "path": path})
        raise OSError(errno.EIO, f"injected storage error on {op}", path)


class FaultyFileSystem(AbstractFileSystem):
    """Local files, with the armed one-shot errors of the module docstring."""

    protocol = PROTOCOL
    root_marker = "/"

    def __init__(self, control: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.control = str(control)
        self.local = LocalFileSystem()

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        path = str(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3 :]
        return path.rstrip("/") or "/"

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        _take(self.control, "read" if "r" in mode else "write", path)
        if "w" in mode or "a" in mode:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        return open(path, mode)  # fsspec closes what _open returns

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self.local.ls(self._strip_protocol(path), detail=detail)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return dict(self.local.info(self._strip_protocol(path)))

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        os.makedirs(self._strip_protocol(path), exist_ok=True)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def rm_file(self, path: str) -> None:
        os.remove(self._strip_protocol(path))

    def rmdir(self, path: str) -> None:
        os.rmdir(self._strip_protocol(path))

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        for p in [path] if isinstance(path, str) else list(path):
            p = self._strip_protocol(p)
            if os.path.isdir(p):
                if not recursive:
                    raise IsADirectoryError(p)
                shutil.rmtree(p)
            else:
                os.remove(p)


fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)
