"""Writing one shard file of a checkpoint, and the record the commit needs of it.

A shard is a safetensors file written directly from the tensors' memory (no
serialised copy), each tensor's checksum computed on a helper thread while the
previous one is written. On local disk it goes into the save's temporary
directory and is fsynced; on object stores under the save's own prefix in the
step's directory, invisible to readers until the commit marker names it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

from planaria.checkpoint.checksum import (
    ALGORITHM,
    Segment,
    byte_view,
    checksum_function,
    read_verified,
)
from planaria.checkpoint.direct_io import read_back_direct, write_direct
from planaria.checkpoint.errors import CorruptCheckpoint, ManifestError
from planaria.checkpoint.layout import (
    DEFAULT_SAVE_ID,
    check_save_id,
    save_dir_name,
    shard_file_name,
    step_dir_name,
    tmp_dir_name,
)
from planaria.checkpoint.manifest import FileEntry
from planaria.checkpoint.plan import parse_slice_key
from planaria.checkpoint.shard_file import ShardLayout, lay_out
from planaria.checkpoint.staging import ShardImage
from planaria.checkpoint.storage import Storage

_log = logging.getLogger("planaria.checkpoint")

__all__ = ["RecordedSlice", "ShardRecord", "write_image", "write_shard"]


@dataclass(frozen=True, slots=True)
class RecordedSlice:
    """A slice as written: tensor ``name``, ``rows`` of dim 0 (None: whole), the slice's
    own ``shape``, its byte range in the file and checksum."""

    name: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    rows: tuple[int, int] | None
    offsets: tuple[int, int]
    crc32: int


@dataclass(frozen=True, slots=True)
class ShardRecord:
    """What one writer wrote; JSON-able with :meth:`to_dict` / :meth:`from_dict`."""

    step: int
    save_id: str
    shard_index: int
    num_shards: int
    file: FileEntry
    slices: tuple[RecordedSlice, ...]
    checksum: str = ALGORITHM

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ShardRecord:
        """Rebuilds a record from :meth:`to_dict`'s output; :class:`ManifestError` if malformed."""
        try:
            return cls(
                step=int(doc["step"]),
                save_id=str(doc["save_id"]),
                shard_index=int(doc["shard_index"]),
                num_shards=int(doc["num_shards"]),
                file=FileEntry(**doc["file"]),
                slices=tuple(
                    RecordedSlice(
                        name=s["name"], key=s["key"], dtype=s["dtype"],
                        shape=tuple(s["shape"]),
                        rows=_pair(s["rows"]) if s["rows"] is not None else None,
                        offsets=_pair(s["offsets"]),
                        crc32=int(s["crc32"]),
                    )
                    for s in doc["slices"]
                ),
                checksum=str(doc.get("checksum", "crc32")),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ManifestError(f"malformed shard record: {err!r}") from err


def _pair(v: Any) -> tuple[int, int]:
    a, b = v
    return int(a), int(b)


RECORD_SUFFIX = ".record.json"
"""A shard's record, written beside it once the shard is written and read back: a save whose
writers all finished can be committed from the files alone (by a controller started
again, say). The save's own description lies beside them in :data:`SAVE_FILE`."""
SAVE_FILE = "save.json"


def record_path(shard_path: str) -> str:
    """Where the record of the shard at ``shard_path`` is kept."""
    return shard_path.removesuffix(".safetensors") + RECORD_SUFFIX


def write_record(root: str, record: ShardRecord, *, written_t: float,
                 storage_options: Mapping[str, Any] | None = None, fsync: bool = True) -> None:
    """Writes ``record`` beside its shard (after the shard's read-back: it vouches for it)."""
    storage = Storage(root, storage_options)
    directory = shard_dir(storage, record.step, record.save_id)
    body = json.dumps({**record.to_dict(), "written_t": written_t}).encode()
    storage.write_bytes(record_path(f"{directory}/{record.file.name}"), body, fsync=fsync)


def write_description(root: str, step: int, save_id: str | None, describe: dict[str, Any], *,
                      storage_options: Mapping[str, Any] | None = None,
                      fsync: bool = True) -> None:
    """Writes a save's description (:data:`SAVE_FILE`) into its shard directory."""
    storage = Storage(root, storage_options)
    directory = shard_dir(storage, step, check_save_id(save_id or DEFAULT_SAVE_ID))
    storage.makedirs(directory)
    storage.write_bytes(f"{directory}/{SAVE_FILE}", json.dumps(describe).encode(), fsync=fsync)


def remove_shard(root: str, step: int, shard_index: int, num_shards: int, save_id: str | None,
                 *, storage_options: Mapping[str, Any] | None = None) -> None:
    """Removes what a failed write of a shard left (its file, its record), best effort: a
    disk that filled must not keep the partial file."""
    storage = Storage(root, storage_options)
    directory = shard_dir(storage, step, check_save_id(save_id or DEFAULT_SAVE_ID))
    path = f"{directory}/{shard_file_name(shard_index, num_shards)}"
    for p in (path, record_path(path)):
        try:
            if storage.exists(p):
                storage.remove(p)
        except OSError as err:
            _log.warning("could not remove the partial %s: %s", p, err)


def shard_dir(storage: Storage, step: int, save_id: str) -> str:
    """Where the shards of a save are written: a temporary directory on local disk, the
    save's own prefix in the step's directory on object stores."""
    if storage.local:
        return storage.path(tmp_dir_name(step, save_id))
    return storage.path(step_dir_name(step), save_dir_name(save_id))


def _destination(
    root: str, step: int, shard_index: int, num_shards: int, save_id: str | None,
    storage_options: Mapping[str, Any] | None,
) -> tuple[Storage, str, str]:
    """The storage, the checked save id and the path of a shard file (its directory made)."""
    sid = check_save_id(save_id or DEFAULT_SAVE_ID)
    storage = Storage(root, storage_options)
    directory = shard_dir(storage, step, sid)
    storage.makedirs(directory)
    return storage, sid, f"{directory}/{shard_file_name(shard_index, num_shards)}"


def _record(layout: ShardLayout, crcs: list[int], step: int, save_id: str, shard_index: int,
            num_shards: int, path: str, algorithm: str) -> ShardRecord:
    """What the commit needs of a shard written with ``layout``; ``crcs`` per entry."""
    slices = []
    for e, crc in zip(layout.entries, crcs, strict=True):
        name, rows = parse_slice_key(e.key)
        slices.append(RecordedSlice(name=name, key=e.key, dtype=e.dtype, shape=e.shape,
                                    rows=rows, offsets=(e.begin, e.end), crc32=crc))
    header_crc = checksum_function(algorithm)(layout.head, 0)
    return ShardRecord(
        step=step, save_id=save_id, shard_index=shard_index, num_shards=num_shards,
        file=FileEntry(name=path.rsplit("/", 1)[-1], size=layout.size,
                       data_start=layout.data_start, header_crc32=header_crc),
        slices=tuple(slices), checksum=algorithm,
    )


def _bytes_view(t: torch.Tensor) -> memoryview:
    return byte_view(t.detach().cpu().contiguous())


def write_shard(
    root: str,
    step: int,
    shard_index: int,
    num_shards: int,
    share: Mapping[str, torch.Tensor],
    *,
    save_id: str | None = None,
    fsync: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    algorithm: str = ALGORITHM,
    verify: bool = False,
) -> ShardRecord:
    """Writes ``share`` (slice key -> CPU tensor, e.g. from :func:`take_share`) as shard
    ``shard_index`` of ``num_shards`` of the checkpoint of ``step`` under ``root``.

    Every writer of one save must pass the same ``save_id`` (see
    :func:`new_save_id`); the default is one fixed id, enough when a save of a
    step is never retried while an older attempt may still be writing. Safe to
    call from a background thread; the tensors must not change until it returns.
    Storage errors propagate as raised by the filesystem (``OSError`` and kin).
    ``algorithm`` names the checksum (``crc32c``; ``crc32`` writes the old format).
    With ``verify`` the file is read back once written and every checksum checked
    (:class:`CorruptCheckpoint` if one differs): a committed checkpoint then needs
    no read-back before older ones are deleted.
    """
    storage, sid, path = _destination(root, step, shard_index, num_shards, save_id,
                                      storage_options)
    layout = lay_out({k: (t.dtype, tuple(t.shape)) for k, t in share.items()}, step)
    views = [_bytes_view(share[e.key]) for e in layout.entries]
    assert [v.nbytes for v in views] == [e.end - e.begin for e in layout.entries]

    crc = checksum_function(algorithm)
    with ThreadPoolExecutor(max_workers=1) as pool:
        crcs = [pool.submit(crc, v, 0) for v in views]
        with storage.open_write(path, fsync=fsync) as f:
            f.write(layout.head)
            for v in views:
                f.write(v)
        record = _record(layout, [fut.result() for fut in crcs], step, sid, shard_index,
                         num_shards, path, algorithm)
    if verify:
        _verify_written(storage, path, record)
    return record


def write_image(
    root: str,
    step: int,
    shard_index: int,
    num_shards: int,
    image: ShardImage,
    *,
    save_id: str | None = None,
    fsync: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    algorithm: str = ALGORITHM,
    verify: bool = False,
    direct: bool = True,
) -> ShardRecord:
    """Writes a shard staged by :meth:`ShardImage.fill` (for ``step``); like
    :func:`write_shard` otherwise. The checksums are taken from the staged bytes. On
    local disk with ``direct`` the file is written and read back with ``O_DIRECT``
    (:mod:`~planaria.checkpoint.direct_io`), else as one buffered write. The image
    must not change until this returns."""
    layout = image.layout
    assert layout is not None, "nothing staged"
    storage, sid, path = _destination(root, step, shard_index, num_shards, save_id,
                                      storage_options)
    data = image.view()
    crc = checksum_function(algorithm)
    with ThreadPoolExecutor(max_workers=1) as pool:
        crcs = [pool.submit(crc, data[e.begin : e.end], 0) for e in layout.entries]
        if not (direct and storage.local and write_direct(path, data, layout.size, fsync=fsync)):
            with storage.open_write(path, fsync=fsync) as f:
                f.write(data[: layout.size])
        record = _record(layout, [fut.result() for fut in crcs], step, sid, shard_index,
                         num_shards, path, algorithm)
    if verify:
        bad = None
        if direct and storage.local:
            bad = read_back_direct(path, layout.size, _segments(record), image.scratch(),
                                   algorithm)
        if bad is None:
            _verify_written(storage, path, record)
        elif bad:
            raise _differs(storage, path, bad)
    return record


def _segments(record: ShardRecord) -> list[Segment]:
    fe = record.file
    segs = [Segment(0, fe.data_start, fe.header_crc32, f"{fe.name}: header")]
    segs += [Segment(s.offsets[0], s.offsets[1], s.crc32, f"{fe.name}: tensor {s.key!r}")
             for s in record.slices]
    return segs


def _differs(storage: Storage, path: str, bad: list[tuple[Segment, int]]) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{storage.url(path)} read back differs from what was written: "
                             + "; ".join(seg.label for seg, _ in bad[:3]))


def _verify_written(storage: Storage, path: str, record: ShardRecord) -> None:
    """Reads the shard just written back and checks every checksum the record holds."""
    with storage.open_read(path) as f:
        bad = read_verified(f, [(0, record.file.size, None)], _segments(record),
                            algorithm=record.checksum)
    if bad:
        raise _differs(storage, path, bad)
