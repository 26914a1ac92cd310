"""``faulty://``: local files through fsspec, with storage faults on demand.

A checkpoint root ``faulty:///abs/path`` stores real files under ``/abs/path``
but goes through fsspec's generic (non-POSIX) path of
:class:`~planaria.checkpoint.storage.Storage`, so every open is seen here
(``control`` is a storage option, so every process that opens the root sees the
same control directory). Three kinds of fault:

- **one-shot faults on an open** (``CONTROL/arm-write-<seq>.json`` or
  ``CONTROL/arm-read-<seq>.json``, see :func:`arm`): the next open for that kind
  of access whose path matches, in whichever process comes first, takes the
  oldest armed file (an atomic rename) and logs it to ``CONTROL/fired.jsonl``.
  Its ``action``: ``eio`` raises ``OSError(EIO)`` at the open; ``kill`` and
  ``term`` let the open through and, at the first read or write, move
  ``fraction`` of its bytes, then send the process SIGKILL (a writer dies
  part-way through its shard, a reader part-way through a restore) or SIGTERM
  (a preemption notice while the shard is written; the write goes on). Errors
  armed one after the other wait their turn: a second arming never replaces a
  first that has not fired.
- **a full disk** (``CONTROL/full.json``, see :func:`fill` and :func:`free`):
  while it is there, every write writes ``fraction`` of its bytes, then raises
  ``OSError(ENOSPC)``.
- **the write record**: every file opened for writing appends ``{path, t, pid}``
  to ``CONTROL/writes.jsonl`` when it is closed (what finished writing, and
  when, on the campaign's own clock: the verdict dates a save's last writer
  from it).

Without ``control``, none of those: a root of plain local files seen as an object store.
And in one process (a unit test), **counted failures** (see :func:`counted_failures`):
the calls of the chosen kinds (``read``: an open for reading; ``write``: an open for
writing; ``meta``: ``ls`` and ``info``, and so ``exists`` and ``size``) on paths holding
``fail_match`` are numbered from 1 per ``fail_token``, and those numbered ``fail_calls``
raise ``OSError(EIO)``.

**Latency**, with or without ``control``: the same calls each wait first, a slow store.
The storage option ``latency`` (see :func:`with_latency`) sets it for the root's life;
``CONTROL/latency.json`` (see :func:`set_latency`) adds to it, in every process, while
the job runs: set, changed, or cleared at any time.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

__all__ = ["LATENCY_KINDS", "PROTOCOL", "FaultyFileSystem", "arm", "armed", "counted_failures",
           "fill", "fired", "free", "log_fired", "set_latency", "with_latency", "writes"]

PROTOCOL = "faulty"
FIRED_LOG = "fired.jsonl"
WRITES_LOG = "writes.jsonl"
FULL_FILE = "full.json"
LATENCY_FILE = "latency.json"
OPEN_ACTIONS = ("eio", "kill", "term")
LATENCY_KINDS = ("read", "write", "meta")
"""The calls a latency delays (and counted failures count): an open for reading, an open
for writing, ``ls`` and ``info``."""


def arm(
    control: str | Path, op: str, *, fault_id: str, match: str = "", skip_pid: int | None = None,
    only_pid: int | None = None, skip_thread: str | None = None, action: str = "eio",
    fraction: float = 0.5,
) -> None:
    """Arms a one-shot fault on the next ``op`` ("read" or "write") on a faulty:// root
    whose path contains ``match``, in any process but ``skip_pid`` (or only in
    ``only_pid``), on a thread whose name does not begin with ``skip_thread``: ``action``
    (see the module docstring)."""
    if op not in ("read", "write"):
        raise ValueError(f"op={op!r} is not valid: 'read' or 'write'")
    if action not in OPEN_ACTIONS:
        raise ValueError(f"action={action!r} is not valid: one of {', '.join(OPEN_ACTIONS)}")
    control = Path(control)
    tmp = control / f".tmp-arm-{os.getpid()}-{time.monotonic_ns()}"
    tmp.write_text(json.dumps({"id": fault_id, "match": match, "skip_pid": skip_pid,
                               "only_pid": only_pid, "skip_thread": skip_thread, "action": action,
                               "fraction": fraction}))
    os.replace(tmp, control / f"arm-{op}-{time.time_ns():020d}.json")  # its order: the name


def counted_failures(token: str, fail_on: tuple[str, ...], fail_calls: tuple[int, ...],
                     match: str = "") -> dict[str, Any]:
    """Storage options for a ``faulty://`` root without a control directory whose counted
    calls (``fail_on``: ``read``, ``write``, ``meta``; on paths holding ``match``) numbered
    ``fail_calls`` fail with ``OSError(EIO)``; ``token`` names a fresh count."""
    return {"fail_on": tuple(fail_on), "fail_calls": tuple(fail_calls), "fail_token": token,
            "fail_match": match}


def _latency_of(read: float, write: float, meta: float, match: str) -> dict[str, Any]:
    latency = {"read": read, "write": write, "meta": meta}
    if any(s < 0 for s in latency.values()):
        raise ValueError(f"a latency is seconds >= 0, not {latency}")
    return {**latency, "match": match}


def with_latency(options: dict[str, Any] | None = None, *, read: float = 0.0,
                 write: float = 0.0, meta: float = 0.0, match: str = "") -> dict[str, Any]:
    """Storage options for a ``faulty://`` root (``options`` and this) whose calls of each
    kind (:data:`LATENCY_KINDS`) on paths holding ``match`` wait that many seconds first."""
    return {**(options or {}), "latency": _latency_of(read, write, meta, match)}


def set_latency(control: str | Path, *, read: float = 0.0, write: float = 0.0,
                meta: float = 0.0, match: str = "") -> None:
    """From now on, in every process, a ``faulty://`` root's calls of each kind on paths
    holding ``match`` wait that many seconds first (beside its ``latency`` option); all
    zero clears it."""
    latency = _latency_of(read, write, meta, match)
    path = Path(control) / LATENCY_FILE
    if not (read or write or meta):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    tmp = Path(control) / f".tmp-latency-{os.getpid()}-{threading.get_ident()}"
    tmp.write_text(json.dumps(latency))
    os.replace(tmp, path)


def _control_file(control: str, name: str) -> dict[str, Any] | None:
    """The control folder's ``name`` (the latency set, a disk filled), None when absent or
    being written."""
    try:
        with open(os.path.join(control, name)) as f:
            return dict(json.load(f))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def fill(control: str | Path, *, fault_id: str, fraction: float = 0.5) -> None:
    """The checkpoint root's disk is full from now on: every write fails part-way (ENOSPC)."""
    control = Path(control)
    tmp = control / f".tmp-full-{os.getpid()}"
    tmp.write_text(json.dumps({"id": fault_id, "fraction": fraction}))
    os.replace(tmp, control / FULL_FILE)


def free(control: str | Path) -> None:
    """The checkpoint root's disk has room again."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(Path(control) / FULL_FILE)


def log_fired(control: str | Path, record: dict[str, Any]) -> None:
    """Appends one record to ``CONTROL/fired.jsonl``, timed the moment before the fault acts.
    A plain write: the kernel holds it once ``write`` returns, so it survives the process's
    death a moment later (no fsync, whose wait on a loaded disk would come between the
    record's time and the fault, and count as detection time)."""
    line = json.dumps({**record, "t": time.time(), "pid": os.getpid()}) + "\n"
    fd = os.open(Path(control) / FIRED_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
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


def writes(control: str | Path) -> list[dict[str, Any]]:
    """Every file written through faulty://, as it was closed: ``path``, ``t``, ``pid``."""
    return read_jsonl(Path(control) / WRITES_LOG)


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


def _take(control: str, op: str, path: str) -> dict[str, Any] | None:
    """Takes the oldest fault armed for this open: raises for ``eio``, returns the others."""
    for name in _armed_files(control, op):
        armed_file = os.path.join(control, name)
        try:
            with open(armed_file) as f:
                armed_for = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        if armed_for.get("match", "") not in path or armed_for.get("skip_pid") == os.getpid():
            continue
        if armed_for.get("only_pid") not in (None, os.getpid()):
            continue
        skip_thread = armed_for.get("skip_thread")
        if skip_thread and threading.current_thread().name.startswith(skip_thread):
            continue
        taken = os.path.join(control, f"taken-{name}.{os.getpid()}.{time.monotonic_ns()}")
        try:
            os.rename(armed_file, taken)  # atomic: one opener in one process wins
        except FileNotFoundError:
            continue
        action = armed_for.get("action", "eio")
        if action != "eio":
            return armed_for  # logged when it fires, inside the read or the write
        log_fired(control, {"id": armed_for.get("id"), "action": f"storage_{op}", "path": path})
        raise OSError(errno.EIO, f"injected storage error on {op}", path)
    return None


def _own_worker_name() -> str | None:
    """This process's planaria worker name (``w3``, a follower ``w3.1``), from the marker
    every worker leaves (see planaria.control.drain); None in the controller."""
    from planaria.wire.worker_markers import worker_dir

    try:
        with open(worker_dir() / str(os.getpid())) as f:
            return str(json.load(f).get("name"))
    except (OSError, ValueError):
        return None


class _FaultyFile:
    """A local file that can die part-way through, fill the disk, and logs its close."""

    def __init__(self, f: Any, *, path: str, control: str, writing: bool,
                 armed: dict[str, Any] | None, full: dict[str, Any] | None) -> None:
        self._f = f
        self._path = path
        self._control = control
        self._writing = writing
        self._armed = armed
        self._full = full
        self._full_logged = False
        self._failed = False  # a write raised: the file is not written (no close record)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> Any:
        return iter(self._f)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._full is not None:
            part = int(len(view) * float(self._full.get("fraction", 0.5)))
            self._f.write(view[:part])
            self._f.flush()
            self._failed = True
            if not self._full_logged:
                self._full_logged = True
                log_fired(self._control, {"id": self._full.get("id"), "action": "disk_full",
                                          "path": self._path})
            raise OSError(errno.ENOSPC, "injected: no space left on device", self._path)
        if self._armed is not None:
            armed, self._armed = self._armed, None
            part = int(len(view) * float(armed.get("fraction", 0.5)))
            self._f.write(view[:part])
            self._f.flush()
            self._fire(armed)
            return int(part + self._f.write(view[part:]))
        try:
            return int(self._f.write(data))
        except OSError:
            self._failed = True
            raise

    def read(self, size: int = -1) -> bytes:
        if self._armed is not None:
            armed, self._armed = self._armed, None
            total = os.fstat(self._f.fileno()).st_size - self._f.tell()
            want = total if size is None or size < 0 else min(size, total)
            head = self._f.read(int(want * float(armed.get("fraction", 0.5))))
            self._fire(armed)
            return bytes(head + self._f.read(-1 if size is None or size < 0 else size - len(head)))
        return bytes(self._f.read(size))

    def readinto(self, buffer: Any) -> int:
        if self._armed is not None:
            view = memoryview(buffer).cast("B")
            data = self.read(len(view))
            view[: len(data)] = data
            return len(data)
        return int(self._f.readinto(buffer))

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.close()
        if self._writing and not self._failed:
            line = json.dumps({"path": self._path, "t": time.time(), "pid": os.getpid()}) + "\n"
            fd = os.open(os.path.join(self._control, WRITES_LOG),
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)

    def _fire(self, armed: dict[str, Any]) -> None:
        action = armed.get("action")
        log_fired(self._control, {"id": armed.get("id"), "action": f"{action}_in_io",
                                  "path": self._path, "worker": _own_worker_name()})
        os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGTERM)


class FaultyFileSystem(AbstractFileSystem):
    """Local files, with the faults of the module docstring."""

    protocol = PROTOCOL
    root_marker = "/"
    _counts: ClassVar[dict[str, int]] = {}  # fail_token -> the calls counted so far
    _counts_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, control: str | None = None, *, fail_on: tuple[str, ...] = (),
                 fail_calls: tuple[int, ...] = (), fail_token: str = "", fail_match: str = "",
                 latency: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.control = None if control is None else str(control)
        self.local = LocalFileSystem()
        self.fail_on = tuple(fail_on)
        self.fail_calls = frozenset(fail_calls)
        self.fail_token = fail_token
        self.fail_match = fail_match
        self.latency = latency

    def _count(self, kind: str, path: str) -> None:
        """A call of ``kind``: waits its latency, then, a counted failure, raises on the
        calls numbered ``fail_calls``."""
        control = self.control
        for latency in (self.latency,
                        None if control is None else _control_file(control, LATENCY_FILE)):
            if latency is not None and latency.get("match", "") in path:
                time.sleep(float(latency.get(kind, 0.0)))
        if kind not in self.fail_on or self.fail_match not in path:
            return
        with self._counts_lock:
            n = self._counts[self.fail_token] = self._counts.get(self.fail_token, 0) + 1
        if n in self.fail_calls:
            raise OSError(errno.EIO, f"injected I/O error (call {n}, {kind})", path)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        path = str(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3 :]
        return path.rstrip("/") or "/"

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        writing = "w" in mode or "a" in mode
        op = "write" if writing else "read"
        self._count(op, path)
        if self.control is None:
            if writing:
                os.makedirs(os.path.dirname(path), exist_ok=True)
            return open(path, mode)  # fsspec closes what _open returns
        armed = _take(self.control, op, path)
        if writing:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        full = _control_file(self.control, FULL_FILE) if writing else None
        return _FaultyFile(open(path, mode), path=path, control=self.control, writing=writing,
                           armed=armed, full=full)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self._count("meta", path)
        return self.local.ls(self._strip_protocol(path), detail=detail)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self._count("meta", path)
        return dict(self.local.info(self._strip_protocol(path)))

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        os.makedirs(self._strip_protocol(path), exist_ok=True)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def rm_file(self, path: str) -> None:
        os.remove(self._strip_protocol(path))

    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth: int | None = None,
           **kwargs: Any) -> None:
        """A file moved over another whole, as an object store's server-side copy is."""
        os.replace(self._strip_protocol(path1), self._strip_protocol(path2))

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
