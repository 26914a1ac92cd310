"""The blocking part of a save: copying a writer's share into reused host buffers
(one per slice, or one image of the whole shard file)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from planaria.checkpoint.checksum import byte_view
from planaria.checkpoint.direct_io import ALIGN
from planaria.checkpoint.plan import ShardPlan, SliceSpec
from planaria.checkpoint.shard_file import ShardLayout, lay_out

__all__ = ["ShardImage", "StagingBuffers", "slice_of", "take_share"]


class StagingBuffers:
    """Host buffers kept from one save to the next, keyed by slice key.

    Reusing them avoids first-touch page faults, which cost more than the copy.
    A buffer must not be overwritten while a write of the previous save still
    reads it: :class:`AsyncShardWriter` never lets saves overlap.
    """

    def __init__(self, *, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def buffer(self, key: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The buffer for ``key``, reallocated only if its shape or dtype changed."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pin_memory)
            self._buffers[key] = buf
        return buf

    def retain(self, keys: set[str]) -> None:
        """Frees the buffers not named in ``keys``."""
        for key in set(self._buffers) - keys:
            del self._buffers[key]

    def clear(self) -> None:
        self._buffers.clear()


def take_share(
    tensors: Mapping[str, torch.Tensor],
    plan: ShardPlan,
    staging: StagingBuffers | None = None,
) -> dict[str, torch.Tensor]:
    """Copies this writer's slices of ``tensors`` into host memory and returns them by key.

    Blocks until every copy is done, after which the live tensors may change.
    With ``staging`` the copies land in its reused buffers (the result then
    aliases them until the next call); without, in fresh tensors. Raises
    ``KeyError`` for a tensor the plan names but ``tensors`` lacks, ``ValueError``
    if a row range does not fit the tensor.
    """
    out: dict[str, torch.Tensor] = {}
    device_copies = False
    for spec in plan.slices:
        src = slice_of(tensors, spec)
        if staging is not None:
            dst = staging.buffer(spec.key, src.shape, src.dtype)
        else:
            dst = torch.empty(src.shape, dtype=src.dtype, device="cpu")
        device_copies |= src.device.type != "cpu"
        dst.copy_(src, non_blocking=src.device.type != "cpu")
        out[spec.key] = dst
    if device_copies and torch.cuda.is_available():
        torch.cuda.synchronize()
    if staging is not None:
        staging.retain(set(out))
    return out


class ShardImage:
    """A whole shard file, header and tensors, staged in one reused host buffer.

    The buffer starts on a :data:`~planaria.checkpoint.direct_io.ALIGN` boundary
    and is padded to a multiple of it, so the file can be written with one
    direct write (no page-cache copy) and checksummed from memory. It is kept
    from one save to the next (reallocated only when the shard grows): reusing
    it avoids first-touch page faults, which cost more than the copy. Also holds
    the aligned scratch buffer of the read-back.
    """

    SCRATCH_BYTES = 8 << 20

    def __init__(self, *, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._raw: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        #: The layout of the staged shard (None until :meth:`fill`).
        self.layout: ShardLayout | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes held (image and scratch)."""
        return sum(t.numel() for t in (self._raw, self._scratch) if t is not None)

    def _aligned(self, nbytes: int, old: torch.Tensor | None) -> torch.Tensor:
        if old is not None and old.numel() - ALIGN >= nbytes:
            return old
        return torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=self.pin_memory)

    def _window(self, raw: torch.Tensor, nbytes: int) -> torch.Tensor:
        skip = -raw.data_ptr() % ALIGN
        return raw[skip : skip + nbytes]

    def fill(self, tensors: Mapping[str, torch.Tensor], plan: ShardPlan, step: int) -> None:
        """Lays out this writer's share of ``tensors`` for ``step`` and copies it in.

        Blocks until every copy is done, after which the live tensors may change.
        ``KeyError`` for a tensor the plan names but ``tensors`` lacks, ``ValueError``
        if a row range does not fit the tensor.
        """
        sources = {spec.key: slice_of(tensors, spec) for spec in plan.slices}
        layout = lay_out({k: (t.dtype, tuple(t.shape)) for k, t in sources.items()}, step)
        padded = layout.size + (-layout.size % ALIGN)
        self._raw = self._aligned(padded, self._raw)
        image = self._window(self._raw, padded)
        head = torch.frombuffer(bytearray(layout.head), dtype=torch.uint8)
        image[: layout.data_start].copy_(head)
        image[layout.size :].zero_()
        device_copies = False
        for e in layout.entries:
            src = sources[e.key]
            dst = image[e.begin : e.end].view(src.dtype).view(src.shape)
            device_copies |= src.device.type != "cpu"
            dst.copy_(src, non_blocking=src.device.type != "cpu")
        if device_copies and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.layout = layout

    def view(self) -> memoryview:
        """The staged file's bytes, padded with zeros to a multiple of ``ALIGN``."""
        assert self.layout is not None and self._raw is not None, "nothing staged"
        size = self.layout.size
        return byte_view(self._window(self._raw, size + (-size % ALIGN)))

    def scratch(self) -> memoryview:
        """An aligned buffer for reading the file back: :attr:`SCRATCH_BYTES`, or less for
        a smaller shard."""
        assert self.layout is not None, "nothing staged"
        size = self.layout.size
        nbytes = min(self.SCRATCH_BYTES, size + (-size % ALIGN))
        self._scratch = self._aligned(nbytes, self._scratch)
        return byte_view(self._window(self._scratch, nbytes))

    def clear(self) -> None:
        self._raw = self._scratch = None
        self.layout = None


def slice_of(tensors: Mapping[str, torch.Tensor], spec: SliceSpec) -> torch.Tensor:
    """The plan's slice ``spec`` of ``tensors`` as a view (``ValueError`` if its rows do not
    fit the tensor, a shard starting at row ``spec.origin`` of the whole)."""
    src = tensors[spec.name].detach()
    if spec.rows is not None:
        begin, end = spec.rows[0] - spec.origin, spec.rows[1] - spec.origin
        if src.dim() == 0 or begin < 0 or end > src.shape[0]:
            raise ValueError(f"rows {spec.rows} do not fit {spec.name!r} {tuple(src.shape)}")
        src = src[begin:end]
    return src
