"""Finding, verifying and loading checkpoints.

Only committed checkpoints are considered: on local disk a directory with its
final name, anywhere a commit marker that names the manifest. Loading parses
``manifest.json`` and takes each tensor's bytes from the byte range the manifest
gives; the safetensors files are never unpickled (nothing is) and their checksums
are checked chunk by chunk while the next chunk is being read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from planaria.checkpoint.checksum import Segment, byte_view, read_verified
from planaria.checkpoint.dtypes import DTYPES
from planaria.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpoint,
    IncompleteCheckpoint,
    ManifestError,
)
from planaria.checkpoint.layout import MANIFEST, MARKER, parse_dir_name
from planaria.checkpoint.manifest import (
    FileEntry,
    Manifest,
    SliceEntry,
    TensorEntry,
    marker_fields,
    parse_manifest,
    parse_marker,
)
from planaria.checkpoint.storage import Storage

__all__ = [
    "CheckpointInfo",
    "Restored",
    "VerifyReport",
    "list_checkpoints",
    "load_checkpoint",
    "read_manifest",
    "verify_checkpoint",
]

_IO_THREADS = 4
_MISSING = "file is missing"


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A step directory under a root. ``committed`` only says a commit marker is present."""

    step: int
    path: str
    committed: bool
    nbytes: int


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Outcome of :func:`verify_checkpoint`: ``problems`` name the file (and tensor) at fault."""

    path: str
    step: int | None
    ok: bool
    problems: list[str] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Restored:
    """A loaded checkpoint."""

    path: str
    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


def list_checkpoints(
    root: str, *, storage_options: Mapping[str, Any] | None = None
) -> list[CheckpointInfo]:
    """The step directories under ``root`` (not temporary ones), oldest first. Cheap: reads
    no file; ``committed`` means the marker exists, not that the checkpoint verifies."""
    st = Storage(root, storage_options)
    out = []
    for name in st.listdir():
        parsed = parse_dir_name(name)
        if parsed is None or parsed[1] != "final":
            continue
        path = st.path(name)
        out.append(CheckpointInfo(parsed[0], st.url(path), st.exists(f"{path}/{MARKER}"),
                                  st.du(path)))
    return sorted(out, key=lambda c: c.step)


def read_run_id(path: str, *, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The run that committed the checkpoint at ``path``, from its marker (None: a marker
    that names none, from before runs had ids). Cheap: reads the marker only."""
    st = Storage(path, storage_options)
    try:
        marker = st.read_bytes(st.path(MARKER))
    except FileNotFoundError as err:
        raise IncompleteCheckpoint(f"{path} is not committed (no {MARKER} marker)") from err
    try:
        return marker_fields(marker)[1]
    except ManifestError as err:
        raise ManifestError(f"{path}: {err}") from err


def read_manifest(path: str, *, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """The manifest of the committed checkpoint at ``path``, checked against its marker.

    Raises :class:`IncompleteCheckpoint` if it is not committed, :class:`ManifestError`
    if the manifest is malformed or not the one the marker commits.
    """
    st = Storage(path, storage_options)
    try:
        marker = st.read_bytes(st.path(MARKER))
    except FileNotFoundError as err:
        raise IncompleteCheckpoint(f"{path} is not committed (no {MARKER} marker)") from err
    try:
        data_dir, _ = marker_fields(marker)
    except ManifestError as err:
        raise ManifestError(f"{path}: {err}") from err
    where = st.path(data_dir, MANIFEST) if data_dir else st.path(MANIFEST)
    try:
        data = st.read_bytes(where)
    except FileNotFoundError as err:
        raise IncompleteCheckpoint(f"{path}: {MANIFEST} is missing") from err
    try:
        parse_marker(marker, data)
        manifest = parse_manifest(data)
    except ManifestError as err:
        raise ManifestError(f"{path}: {err}") from err
    if manifest.data_dir != data_dir:
        raise ManifestError(f"{path}: the manifest names data_dir {manifest.data_dir!r}, the "
                            f"marker {data_dir!r}")
    parsed = parse_dir_name(st.root.rsplit("/", 1)[-1])
    if parsed is not None and parsed[0] != manifest.step:
        raise ManifestError(f"{path}: manifest is for step {manifest.step}")
    return manifest


def _label(fe: FileEntry, name: str, s: SliceEntry) -> str:
    rows = f" rows {s.rows[0]}:{s.rows[1]}" if s.rows is not None else ""
    return f"{fe.name}: tensor {name!r}{rows}"


def _file_path(st: Storage, manifest: Manifest, fe: FileEntry) -> str:
    return st.path(manifest.data_dir, fe.name) if manifest.data_dir else st.path(fe.name)


def _check_sizes(st: Storage, manifest: Manifest, names: Collection[str]) -> list[str]:
    """Problems with the sizes of files ``names`` on storage against the manifest: checked
    before any memory is allocated for their tensors (a forged manifest may claim any shape)."""
    problems = []
    for fe in manifest.files:
        if fe.name not in names:
            continue
        try:
            size = st.size(_file_path(st, manifest, fe))
        except FileNotFoundError:
            problems.append(f"{fe.name}: {_MISSING}")
            continue
        if size != fe.size:
            problems.append(f"{fe.name}: file has {size} bytes, the manifest says {fe.size}")
    return problems


def _read_file(
    st: Storage,
    path: str,
    fe: FileEntry,
    wanted: list[tuple[str, SliceEntry]],
    dest: dict[str, memoryview] | None,
    *,
    whole: bool,
    verify: bool,
    algorithm: str,
    on_progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Reads a shard (``whole``) or only the ``wanted`` slices, each slice straight into
    its destination bytes ``dest[key]`` (None: verify only); returns the problems. The
    file's size has been checked (:func:`_check_sizes`)."""
    segs = [Segment(s.offsets[0], s.offsets[1], s.crc32, _label(fe, n, s)) for n, s in wanted]
    if dest is None:
        targets: list[tuple[int, int, memoryview | None]] = [(0, fe.size, None)]
    else:
        targets = [(s.offsets[0], s.nbytes, dest[s.key]) for _, s in wanted if s.nbytes]
    if whole:
        segs.append(Segment(0, fe.data_start, fe.header_crc32, f"{fe.name}: header"))
        if dest is not None:
            targets.append((0, fe.data_start, None))
    try:
        with st.open_read(path) as f:
            bad = read_verified(f, targets, segs if verify else (), algorithm=algorithm,
                                on_progress=on_progress)
    except FileNotFoundError:
        return [f"{fe.name}: {_MISSING}"]
    except EOFError as err:
        return [f"{fe.name}: {err}"]
    return [f"{seg.label}: checksum mismatch (manifest {seg.crc:#010x}, data {got:#010x})"
            for seg, got in bad]


Fixup = tuple[torch.Tensor, torch.Tensor]
"""(rows read into a scratch buffer, where they go): a slice only partly in a window."""


def _extent(t: TensorEntry, s: SliceEntry) -> tuple[int, int]:
    return s.rows if s.rows is not None else (0, t.shape[0] if t.shape else 1)


def _selected(
    chosen: Mapping[str, TensorEntry], rows: Mapping[str, tuple[int, int]] | None
) -> dict[str, list[SliceEntry]]:
    """The slices to read per tensor: all of them, or with ``rows[name] = (begin, end)``
    those holding some of those rows (dim 0). Allocates nothing."""
    out: dict[str, list[SliceEntry]] = {}
    for name, t in chosen.items():
        window = (rows or {}).get(name)
        if window is None:
            out[name] = list(t.slices)
            continue
        if not t.shape or not 0 <= window[0] <= window[1] <= t.shape[0]:
            raise KeyError(f"rows {window} of tensor {name!r} {t.shape}: not in the tensor")
        out[name] = [s for s in t.slices
                     if max(_extent(t, s)[0], window[0]) < min(_extent(t, s)[1], window[1])]
    return out


def _destinations(
    chosen: Mapping[str, TensorEntry],
    read: Mapping[str, list[SliceEntry]],
    into: Mapping[str, torch.Tensor] | None = None,
    rows: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, memoryview], list[Fixup]]:
    """Tensors for ``chosen``, by slice key the bytes each slice of ``read`` is read into,
    and the copies to make after reading.

    A tensor of ``into`` with the same shape and dtype (contiguous, on the CPU) is
    filled in place; the others are fresh. With ``rows[name] = (begin, end)`` only those
    rows of the tensor are wanted: a slice wholly inside goes straight to its place, one
    partly inside through a scratch buffer.
    """
    tensors: dict[str, torch.Tensor] = {}
    dest: dict[str, memoryview] = {}
    fixups: list[Fixup] = []
    for name, t in chosen.items():
        window = (rows or {}).get(name)
        shape = t.shape if window is None else (window[1] - window[0], *t.shape[1:])
        full = into.get(name) if into is not None else None
        if (
            full is None
            or tuple(full.shape) != tuple(shape)
            or full.dtype != DTYPES[t.dtype]
            or not full.is_contiguous()
            or full.device.type != "cpu"
        ):
            full = torch.empty(shape, dtype=DTYPES[t.dtype])
        tensors[name] = full
        first = 0 if window is None else window[0]
        for s in read[name]:
            begin, end = _extent(t, s)
            lo, hi = (begin, end) if window is None else (max(begin, window[0]),
                                                          min(end, window[1]))
            if s.rows is None and window is None:
                dest[s.key] = byte_view(full)
            elif (lo, hi) == (begin, end):
                dest[s.key] = byte_view(full[begin - first : end - first])
            else:
                scratch = torch.empty((end - begin, *t.shape[1:]), dtype=DTYPES[t.dtype])
                dest[s.key] = byte_view(scratch)
                fixups.append((scratch[lo - begin : hi - begin], full[lo - first : hi - first]))
    return tensors, dest, fixups


def _read_all(
    path: str,
    manifest: Manifest,
    names: Collection[str] | None,
    *,
    keep: bool,
    verify: bool,
    storage_options: Mapping[str, Any] | None,
    into: Mapping[str, torch.Tensor] | None = None,
    on_progress: Callable[[int], None] | None = None,
    rows: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    st = Storage(path, storage_options)
    if rows and names is None:
        names = list(manifest.tensors)  # windows: only the slices that hold wanted rows
    if names is not None:
        unknown = sorted(set(names) - set(manifest.tensors))
        if unknown:
            raise KeyError(f"{path} holds no tensor named {unknown[:5]}")
    chosen = manifest.tensors if names is None else {n: manifest.tensors[n] for n in names}
    read = _selected(chosen, rows)
    wanted: dict[str, list[tuple[str, SliceEntry]]] = {fe.name: [] for fe in manifest.files}
    for name, slices in read.items():
        for s in slices:
            wanted[s.file].append((name, s))
    jobs = [(fe, wanted[fe.name]) for fe in manifest.files if names is None or wanted[fe.name]]
    problems = _check_sizes(st, manifest, {fe.name for fe, _ in jobs})
    if problems:  # checked before any memory is allocated (a forged shape may be any size)
        return {}, problems
    tensors, dest, fixups = _destinations(chosen, read, into, rows) if keep else ({}, None, [])
    with ThreadPoolExecutor(max_workers=max(1, min(_IO_THREADS, len(jobs)))) as pool:
        futures = [pool.submit(_read_file, st, _file_path(st, manifest, fe), fe, w, dest,
                               whole=names is None, verify=verify, algorithm=manifest.checksum,
                               on_progress=on_progress)
                   for fe, w in jobs]
        for fut in futures:
            problems += fut.result()
    if problems or not keep:
        return {}, problems
    for scratch, target in fixups:
        target.copy_(scratch)
    return tensors, problems


def load_checkpoint(
    path: str,
    *,
    verify: bool = True,
    names: Collection[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
    on_progress: Callable[[int], None] | None = None,
    manifest: Manifest | None = None,
    rows: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Loads the committed checkpoint at ``path``: ``(tensors by name, meta)``.

    ``into`` names tensors to fill in place (e.g. a replica's live, already touched
    memory: no page faults, no copy afterwards); if the load then fails they hold
    partial data.

    Split tensors come back whole, on the CPU. With ``names`` only those tensors
    are read (only their byte ranges; e.g. a replica reading its share), else
    everything. With ``verify`` every byte read is checksummed (overlapped with
    reading); a whole-checkpoint load then covers every byte of every file.
    ``rows[name] = (begin, end)``: only those rows (dim 0) of that tensor (a sharded
    replica's worker reads its shard, whatever sharding wrote the checkpoint); a stored
    slice that holds some of them is read, and verified, whole.
    ``manifest``: the one :func:`read_manifest` returned for ``path``, when the caller
    has it already (a load in several parts reads it once).
    Raises :class:`IncompleteCheckpoint`, :class:`ManifestError` or
    :class:`CorruptCheckpoint` (all :class:`CheckpointError`), ``KeyError`` for
    an unknown name; storage errors propagate. ``on_progress(n)`` is called (from
    reading threads) after every read of ``n`` bytes.
    """
    if manifest is None:
        manifest = read_manifest(path, storage_options=storage_options)
    tensors, problems = _read_all(path, manifest, names, keep=True, verify=verify,
                                  storage_options=storage_options, into=into,
                                  on_progress=on_progress, rows=rows)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        missing = problems[0].endswith(_MISSING)
        cls = IncompleteCheckpoint if missing else CorruptCheckpoint
        raise cls(f"{path}: " + "; ".join(problems[:3]) + more)
    return tensors, dict(manifest.meta)


def verify_checkpoint(
    path: str, *, storage_options: Mapping[str, Any] | None = None
) -> VerifyReport:
    """Reads every byte of the checkpoint at ``path`` and checks it; never raises a
    :class:`CheckpointError` (problems go in the report)."""
    t0 = time.perf_counter()
    try:
        manifest = read_manifest(path, storage_options=storage_options)
        _, problems = _read_all(path, manifest, None, keep=False, verify=True,
                                storage_options=storage_options)
    except CheckpointError as err:
        return VerifyReport(path, None, False, [str(err)], 0, time.perf_counter() - t0)
    return VerifyReport(path, manifest.step, not problems, problems, manifest.nbytes,
                        time.perf_counter() - t0)
