"""Which writer stores which tensors: a deterministic, byte-balanced plan.

Large tensors are cut into row slices along dim 0 so that N writers get near
equal bytes. Each writer stores its slices under a safetensors key: the tensor's
name for a whole tensor, ``name[begin:end]`` for a row slice (see
:func:`slice_key`).

A sharded replica's worker holds rows of each sharded tensor (FSDP2 shards
along dim 0): :func:`plan_row_shards` plans those rows as slices of the whole
tensor, so the checkpoint looks the same whatever the sharding that wrote it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "ShardPlan",
    "SliceSpec",
    "parse_slice_key",
    "plan_row_shards",
    "plan_shards",
    "slice_key",
]

_SLICE_KEY_RE = re.compile(r"^(.+)\[(\d+):(\d+)\]$")
_MIN_SPLIT_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """Rows ``rows`` (dim 0, end exclusive) of tensor ``name``, or all of it when None."""

    name: str
    rows: tuple[int, int] | None
    nbytes: int
    origin: int = 0
    """The row of the whole tensor where the writer's own tensor starts (a shard of it);
    ``rows`` are of the whole tensor."""

    @property
    def key(self) -> str:
        return slice_key(self.name, self.rows)


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """What writer ``index`` of ``num_shards`` stores."""

    index: int
    num_shards: int
    slices: tuple[SliceSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slices)


def slice_key(name: str, rows: tuple[int, int] | None) -> str:
    """The safetensors key of a slice: ``name`` or ``name[begin:end]``."""
    return name if rows is None else f"{name}[{rows[0]}:{rows[1]}]"


def parse_slice_key(key: str) -> tuple[str, tuple[int, int] | None]:
    """Inverse of :func:`slice_key`."""
    m = _SLICE_KEY_RE.match(key)
    if m is None:
        return key, None
    return m.group(1), (int(m.group(2)), int(m.group(3)))


def check_name(name: str) -> None:
    """``ValueError`` unless ``name`` can name a tensor in a checkpoint."""
    if not isinstance(name, str) or not name or name == "__metadata__":
        raise ValueError(f"bad tensor name {name!r}")
    if _SLICE_KEY_RE.match(name):
        raise ValueError(f"tensor name {name!r} must not end in '[int:int]' (reserved for slices)")


def plan_shards(
    specs: Mapping[str, tuple[Sequence[int], torch.dtype]],
    num_writers: int,
    *,
    split_bytes: int | None = None,
) -> list[ShardPlan]:
    """Assigns every tensor, or row slices of it, to one of ``num_writers`` writers.

    ``specs`` maps names to ``(shape, dtype)``. A tensor over ``split_bytes``
    (default: a quarter of an even share, at least 1 MiB) with more than one
    row is cut along dim 0 into slices of at most ``split_bytes`` (at least one
    row each). Slices go largest first to the writer with the fewest bytes so
    far. The result depends only on the arguments (not on dict order), so every
    writer computes the same plan; its writers may be empty.
    """
    if num_writers < 1:
        raise ValueError(f"num_writers must be >= 1, got {num_writers}")
    items: list[SliceSpec] = []
    sizes = {}
    for name in sorted(specs):
        check_name(name)
        shape, dtype = specs[name]
        sizes[name] = (tuple(int(d) for d in shape), dtype)
    total = sum(math.prod(s) * d.itemsize for s, d in sizes.values())
    if split_bytes is None:
        split_bytes = max(_MIN_SPLIT_BYTES, total // (4 * num_writers))
    if split_bytes < 1:
        raise ValueError(f"split_bytes must be >= 1, got {split_bytes}")
    for name, (shape, dtype) in sizes.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes <= split_bytes or len(shape) == 0 or shape[0] <= 1:
            items.append(SliceSpec(name, None, nbytes))
            continue
        row_bytes = nbytes // shape[0]
        per = max(1, split_bytes // max(1, row_bytes))
        for begin in range(0, shape[0], per):
            end = min(shape[0], begin + per)
            items.append(SliceSpec(name, (begin, end), (end - begin) * row_bytes))
    items.sort(key=lambda s: (-s.nbytes, s.name, s.rows or (0, 0)))
    loads = [0] * num_writers
    assigned: list[list[SliceSpec]] = [[] for _ in range(num_writers)]
    for item in items:
        w = min(range(num_writers), key=lambda i: (loads[i], i))
        loads[w] += item.nbytes
        assigned[w].append(item)
    return [
        ShardPlan(i, num_writers, tuple(sorted(a, key=lambda s: (s.name, s.rows or (0, 0)))))
        for i, a in enumerate(assigned)
    ]


def plan_row_shards(
    specs: Mapping[str, tuple[Sequence[int], torch.dtype]],
    origins: Mapping[str, tuple[Sequence[int], int]],
    num_writers: int,
    *,
    first_index: int,
    num_files: int,
) -> list[ShardPlan]:
    """:func:`plan_shards` for tensors some of which are row shards of whole tensors.

    ``specs``: this worker's tensors (the shards' shapes); ``origins``: for a shard,
    ``(whole shape, first row)``. The plan over ``num_writers`` writers is made on the
    shards; its slices name rows of the whole tensors (a shard that is the whole tensor
    is stored whole), and writer ``i`` writes file ``first_index + i`` of ``num_files``.
    Empty shards are left out.
    """
    present = {n: v for n, v in specs.items() if n not in origins or math.prod(v[0]) > 0}
    out = []
    for plan in plan_shards(present, num_writers):
        slices = []
        for s in plan.slices:
            if s.name not in origins:
                slices.append(s)
                continue
            whole, first = origins[s.name]
            local_rows = int(specs[s.name][0][0])
            begin, end = s.rows if s.rows is not None else (0, local_rows)
            rows: tuple[int, int] | None = (first + begin, first + end)
            if rows == (0, int(whole[0])):
                rows = None
            slices.append(SliceSpec(s.name, rows, s.nbytes, origin=first))
        out.append(ShardPlan(first_index + plan.index, num_files, tuple(slices)))
    return out
