"""Where every byte of a shard file goes: the safetensors header and each slice's range.

One layout is shared by every way a shard is written (tensor by tensor from
views, or as one staged image of the whole file), so the two cannot drift
apart. Widest dtypes first and a header padded to 8 bytes keep every tensor
aligned to its element size inside the file and inside a staged image.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from planaria.checkpoint.dtypes import DTYPES, dtype_name

__all__ = ["ShardEntry", "ShardLayout", "lay_out"]


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One slice in a shard file: its key, dtype name, shape and byte range ``[begin, end)``
    counted from the start of the file."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """A shard file's bytes: ``head`` (length prefix and JSON header), then the entries."""

    head: bytes
    entries: tuple[ShardEntry, ...]

    @property
    def data_start(self) -> int:
        return len(self.head)

    @property
    def size(self) -> int:
        """The file's size in bytes."""
        return self.entries[-1].end if self.entries else len(self.head)


def lay_out(share: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], step: int) -> ShardLayout:
    """The layout of a shard holding ``share`` (slice key -> dtype and shape) of ``step``."""
    items = sorted((-DTYPES[dtype_name(dt)].itemsize, key, dtype_name(dt))
                   for key, (dt, _) in share.items())
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "step": str(step)}}
    pos = 0
    placed = []
    for _, key, dtype in items:
        shape = tuple(int(d) for d in share[key][1])
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        placed.append((key, dtype, shape, pos, pos + nbytes))
        pos += nbytes
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-(8 + len(hjson)) % 8)
    head = len(hjson).to_bytes(8, "little") + hjson
    start = len(head)
    entries = tuple(ShardEntry(key, dtype, shape, start + b, start + e)
                    for key, dtype, shape, b, e in placed)
    return ShardLayout(head=head, entries=entries)
