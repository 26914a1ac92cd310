"""``manifest.json`` and the commit marker: what a checkpoint holds, parsed strictly.

A manifest lists every shard file (name, size, where its data starts, the
checksum of its safetensors header) and every tensor (dtype, full shape, and the
slices it is stored as: file, safetensors key, row range along dim 0 or
``None`` for the whole tensor, absolute byte range in the file, checksum).
:func:`parse_manifest` rejects anything that points outside the checkpoint,
names an unknown dtype, has ranges or sizes that do not add up, or is not the
expected JSON, with :class:`ManifestError`; it never raises anything else.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from planaria.checkpoint.checksum import ALGORITHM, ALGORITHMS, checksum_function
from planaria.checkpoint.dtypes import DTYPES
from planaria.checkpoint.errors import ManifestError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "FileEntry",
    "Manifest",
    "SliceEntry",
    "TensorEntry",
    "marker_bytes",
    "marker_fields",
    "parse_manifest",
    "parse_marker",
]

FORMAT = "planaria-checkpoint"
FORMAT_VERSION = 1
_FILE_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}$")
_U32 = 1 << 32


@dataclass(frozen=True, slots=True)
class SliceEntry:
    """One stored piece of a tensor: ``rows`` along dim 0 (None: the whole tensor)."""

    file: str
    key: str
    rows: tuple[int, int] | None
    offsets: tuple[int, int]
    crc32: int

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor: safetensors ``dtype`` name, full ``shape``, and its slices in row order."""

    dtype: str
    shape: tuple[int, ...]
    slices: tuple[SliceEntry, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True, slots=True)
class FileEntry:
    """A shard file: ``size`` in bytes; tensor data starts at ``data_start``; the bytes
    before it (the safetensors header) have checksum ``header_crc32``."""

    name: str
    size: int
    data_start: int
    header_crc32: int


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything needed to check and load one checkpoint, without opening a shard."""

    step: int
    world_size: int
    save_id: str
    files: tuple[FileEntry, ...]
    tensors: dict[str, TensorEntry]
    meta: dict[str, Any] = field(default_factory=dict)
    user_metadata: dict[str, Any] = field(default_factory=dict)
    planaria_version: str = ""
    torch_version: str = ""
    created_t: float = 0.0
    checksum: str = ALGORITHM
    """The algorithm of every checksum in the manifest (``crc32c``; ``crc32`` in old ones)."""
    data_dir: str = ""
    """Where the shard files are, under the step's directory ("": in it; on object stores
    the save's own prefix, ``save-<save_id>``, so a re-save never touches a committed copy)."""

    @property
    def nbytes(self) -> int:
        """Total bytes of the shard files."""
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        """The manifest as JSON bytes; :func:`parse_manifest` gives back an equal object."""
        doc = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "checksum": self.checksum,
            "step": self.step,
            "world_size": self.world_size,
            "save_id": self.save_id,
            "data_dir": self.data_dir,
            "created_t": self.created_t,
            "planaria_version": self.planaria_version,
            "torch_version": self.torch_version,
            "files": [
                {"name": f.name, "size": f.size, "data_start": f.data_start,
                 "header_crc32": f.header_crc32}
                for f in self.files
            ],
            "tensors": {
                name: {
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "slices": [
                        {"file": s.file, "key": s.key,
                         "rows": list(s.rows) if s.rows is not None else None,
                         "offsets": list(s.offsets), "crc32": s.crc32}
                        for s in t.slices
                    ],
                }
                for name, t in self.tensors.items()
            },
            "meta": self.meta,
            "user_metadata": self.user_metadata,
        }
        try:
            return json.dumps(doc, indent=1, sort_keys=False).encode()
        except (TypeError, ValueError) as err:
            raise ManifestError(f"checkpoint metadata is not JSON-serialisable: {err}") from err


def parse_manifest(data: bytes) -> Manifest:
    """Parses and validates manifest bytes; :class:`ManifestError` on any defect."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError, TypeError) as err:
        raise ManifestError(f"manifest is not valid JSON: {err}") from err
    try:
        return _build(doc)
    except ManifestError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError, OverflowError) as err:
        raise ManifestError(f"malformed manifest: {type(err).__name__}: {err}") from err


def marker_bytes(
    manifest_json: bytes,
    step: int,
    save_id: str,
    algorithm: str = ALGORITHM,
    *,
    data_dir: str = "",
    run_id: str | None = None,
) -> bytes:
    """The commit marker's content: names the exact manifest it commits (its size and its
    checksum with ``algorithm``; the key keeps its first name, ``manifest_crc32``), where
    that manifest is (``data_dir`` under the step's directory) and the run that wrote it."""
    doc: dict[str, Any] = {
        "step": step, "save_id": save_id, "manifest_size": len(manifest_json),
        "checksum": algorithm,
        "manifest_crc32": checksum_function(algorithm)(manifest_json, 0),
    }
    if data_dir:
        doc["data_dir"] = data_dir
    if run_id is not None:
        doc["run_id"] = run_id
    return json.dumps(doc).encode()


def marker_fields(data: bytes) -> tuple[str, str | None]:
    """``(data_dir, run_id)`` of a commit marker ("" and None for markers that name none);
    :class:`ManifestError` if it is malformed or ``data_dir`` is not a plain name."""
    try:
        doc = json.loads(data)
        data_dir = doc.get("data_dir", "")
        run_id = doc.get("run_id")
    except (ValueError, RecursionError, TypeError, AttributeError) as err:
        raise ManifestError(f"commit marker is malformed: {err}") from err
    if data_dir:
        _file_name(data_dir)
    if run_id is not None and not isinstance(run_id, str):
        raise ManifestError(f"commit marker: run_id must be a string, got {run_id!r}")
    return data_dir, run_id


def parse_marker(data: bytes, manifest_json: bytes) -> None:
    """Checks that the marker commits exactly ``manifest_json``; :class:`ManifestError` if not."""
    try:
        doc = json.loads(data)
        size, crc = _int(doc, "manifest_size"), _int(doc, "manifest_crc32")
        algorithm = doc.get("checksum", "crc32")  # markers before CRC-32C named none
        fn = checksum_function(algorithm)
    except (ValueError, RecursionError, TypeError, AttributeError) as err:
        raise ManifestError(f"commit marker is malformed: {err}") from err
    if size != len(manifest_json) or crc != fn(manifest_json, 0):
        raise ManifestError("commit marker does not match manifest.json (size or checksum differ)")


# ---- validation --------------------------------------------------------------------------


def _fail(msg: str) -> ManifestError:
    return ManifestError(f"invalid manifest: {msg}")


def _get(doc: Any, key: str) -> Any:
    if not isinstance(doc, dict):
        raise _fail(f"expected an object holding {key!r}, got {type(doc).__name__}")
    if key not in doc:
        raise _fail(f"missing {key!r}")
    return doc[key]


def _int(doc: Any, key: str, lo: int = 0, hi: int | None = None) -> int:
    v = _get(doc, key)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v >= hi):
        raise _fail(f"{key!r} must be an integer in [{lo}, {hi if hi is not None else 'inf'}), "
                    f"got {v!r}")
    return v


def _str(doc: Any, key: str) -> str:
    v = _get(doc, key)
    if not isinstance(v, str):
        raise _fail(f"{key!r} must be a string, got {v!r}")
    return v


def _pair(v: Any, what: str) -> tuple[int, int]:
    if (not isinstance(v, list) or len(v) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            or not 0 <= v[0] <= v[1]):
        raise _fail(f"{what} must be [begin, end] with 0 <= begin <= end, got {v!r}")
    return v[0], v[1]


def _file_name(v: Any) -> str:
    if not isinstance(v, str) or not _FILE_RE.match(v) or v in (".", ".."):
        raise _fail(f"file name {v!r} is not a plain name inside the checkpoint")
    return v


def _build(doc: Any) -> Manifest:
    if _get(doc, "format") != FORMAT:
        raise _fail(f"'format' must be {FORMAT!r}")
    if _int(doc, "format_version") != FORMAT_VERSION:
        raise _fail(f"unsupported format_version {doc['format_version']} (this reads "
                    f"{FORMAT_VERSION})")
    algorithm = _get(doc, "checksum")
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise _fail(f"unsupported checksum {algorithm!r} (this reads {sorted(ALGORITHMS)})")
    created = _get(doc, "created_t")
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        raise _fail("'created_t' must be a number")
    meta, user = _get(doc, "meta"), _get(doc, "user_metadata")
    if not isinstance(meta, dict) or not isinstance(user, dict):
        raise _fail("'meta' and 'user_metadata' must be objects")
    data_dir = doc.get("data_dir", "") if isinstance(doc, dict) else ""
    if data_dir != "":
        _file_name(data_dir)
    files = _files(_get(doc, "files"))
    tensors = _tensors(_get(doc, "tensors"), files)
    _check_coverage(files, tensors)
    return Manifest(
        step=_int(doc, "step"),
        world_size=_int(doc, "world_size", 1),
        save_id=_str(doc, "save_id"),
        files=tuple(files.values()),
        tensors=tensors,
        meta=meta,
        user_metadata=user,
        planaria_version=_str(doc, "planaria_version"),
        torch_version=_str(doc, "torch_version"),
        created_t=float(created),
        checksum=algorithm,
        data_dir=data_dir,
    )


def _files(raw: Any) -> dict[str, FileEntry]:
    if not isinstance(raw, list) or not raw:
        raise _fail("'files' must be a non-empty list")
    files: dict[str, FileEntry] = {}
    for item in raw:
        name = _file_name(_get(item, "name"))
        if name in files:
            raise _fail(f"file {name!r} listed twice")
        size = _int(item, "size")
        start = _int(item, "data_start", 8)
        if start > size:
            raise _fail(f"file {name!r}: data_start {start} beyond its size {size}")
        files[name] = FileEntry(name, size, start, _int(item, "header_crc32", 0, _U32))
    return files


def _tensors(raw: Any, files: dict[str, FileEntry]) -> dict[str, TensorEntry]:
    if not isinstance(raw, dict):
        raise _fail("'tensors' must be an object")
    out: dict[str, TensorEntry] = {}
    for name, t in raw.items():
        if not name:
            raise _fail("empty tensor name")
        dtype = _str(t, "dtype")
        if dtype not in DTYPES:
            raise _fail(f"tensor {name!r}: unknown dtype {dtype!r}")
        shape_raw = _get(t, "shape")
        if not isinstance(shape_raw, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape_raw
        ):
            raise _fail(f"tensor {name!r}: shape must be a list of non-negative integers")
        shape = tuple(shape_raw)
        slices_raw = _get(t, "slices")
        if not isinstance(slices_raw, list) or not slices_raw:
            raise _fail(f"tensor {name!r}: 'slices' must be a non-empty list")
        slices = tuple(_slice(name, s, files) for s in slices_raw)
        entry = TensorEntry(dtype, shape, slices)
        _check_slices(name, entry)
        out[name] = entry
    return out


def _slice(name: str, raw: Any, files: dict[str, FileEntry]) -> SliceEntry:
    file = _file_name(_get(raw, "file"))
    if file not in files:
        raise _fail(f"tensor {name!r}: slice in unlisted file {file!r}")
    key = _str(raw, "key")
    if not key or key == "__metadata__":
        raise _fail(f"tensor {name!r}: bad safetensors key {key!r}")
    rows_raw = _get(raw, "rows")
    rows = None if rows_raw is None else _pair(rows_raw, f"tensor {name!r} rows")
    offsets = _pair(_get(raw, "offsets"), f"tensor {name!r} offsets")
    entry = files[file]
    if offsets[0] < entry.data_start or offsets[1] > entry.size:
        raise _fail(f"tensor {name!r}: bytes {offsets} outside the data of {file!r}")
    return SliceEntry(file, key, rows, offsets, _int(raw, "crc32", 0, _U32))


def _check_slices(name: str, t: TensorEntry) -> None:
    item = DTYPES[t.dtype].itemsize
    if t.slices[0].rows is None:
        if len(t.slices) != 1:
            raise _fail(f"tensor {name!r}: a whole-tensor slice must be the only one")
        if t.slices[0].nbytes != t.nbytes:
            raise _fail(f"tensor {name!r}: {t.slices[0].nbytes} bytes stored, shape "
                        f"{list(t.shape)} needs {t.nbytes}")
        return
    if not t.shape:
        raise _fail(f"tensor {name!r}: a 0-dim tensor cannot be split into rows")
    row_bytes = math.prod(t.shape[1:]) * item
    expect = 0
    for s in t.slices:
        if s.rows is None or s.rows[0] != expect or s.rows[1] <= s.rows[0]:
            raise _fail(f"tensor {name!r}: row slices must tile [0, {t.shape[0]}) in order")
        if s.nbytes != (s.rows[1] - s.rows[0]) * row_bytes:
            raise _fail(f"tensor {name!r}: rows {list(s.rows)} stored in {s.nbytes} bytes, "
                        f"need {(s.rows[1] - s.rows[0]) * row_bytes}")
        expect = s.rows[1]
    if expect != t.shape[0]:
        raise _fail(f"tensor {name!r}: slices cover {expect} of {t.shape[0]} rows")


def _check_coverage(files: dict[str, FileEntry], tensors: dict[str, TensorEntry]) -> None:
    """Every byte of every file's data belongs to exactly one slice; every slice key is used
    once in the whole checkpoint (a loader fills slices by key: a key used twice would
    leave one tensor unread)."""
    by_file: dict[str, list[SliceEntry]] = {name: [] for name in files}
    seen: dict[str, str] = {}
    for tname, t in tensors.items():
        for s in t.slices:
            if s.key in seen:
                raise _fail(f"slice key {s.key!r} is used twice (tensors {seen[s.key]!r} "
                            f"and {tname!r})")
            seen[s.key] = tname
            by_file[s.file].append(s)
    for name, slices in by_file.items():
        pos = files[name].data_start
        for s in sorted(slices, key=lambda s: s.offsets):
            if s.offsets[0] != pos:
                raise _fail(f"file {name!r}: slice bytes overlap or leave a hole at {pos}")
            pos = s.offsets[1]
        if pos != files[name].size:
            raise _fail(f"file {name!r}: slices end at byte {pos}, the file has "
                        f"{files[name].size}")
