"""The blocking part of a save: copying a writer's share into reused host buffers."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from planaria.checkpoint.plan import ShardPlan

__all__ = ["StagingBuffers", "take_share"]


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
        src = tensors[spec.name].detach()
        if spec.rows is not None:
            begin, end = spec.rows
            if src.dim() == 0 or end > src.shape[0]:
                raise ValueError(f"rows {spec.rows} do not fit {spec.name!r} {tuple(src.shape)}")
            src = src[begin:end]
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
