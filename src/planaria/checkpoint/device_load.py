"""Loading a checkpoint into tensors that live on a device (a GPU), in bounded batches.

:func:`~planaria.checkpoint.restore.load_checkpoint` reads into host tensors. A
replica whose state is on a GPU would need a whole host copy of it first; instead
:func:`load_to_device` reads a batch of tensors at a time into one reused window of
(pinned) host memory, verified as every read is, and copies the batch to the
device before the next one is read: the host holds at most ``budget`` bytes (or the
largest tensor, if bigger). Whole-file checks of the shards' headers are left out
(the restore reads named tensors); every tensor byte is still checksummed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from planaria.checkpoint.manifest import Manifest
from planaria.checkpoint.restore import load_checkpoint, read_manifest

__all__ = ["STAGING_BYTES", "load_to_device", "plan_batches"]

STAGING_BYTES = 256 << 20
"""Host memory a device restore stages through (one window, reused batch after batch)."""
_ALIGN = 64  # every tensor's place in the window: aligned for any dtype's view


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def plan_batches(sizes: Mapping[str, int], budget: int) -> list[list[str]]:
    """Names in batches of at most ``budget`` (aligned) bytes, in name order; a tensor
    bigger than the budget is a batch of its own."""
    batches: list[list[str]] = []
    used = budget
    for name in sorted(sizes):
        need = _aligned(sizes[name])
        if used + need > budget or not batches:
            batches.append([])
            used = 0
        batches[-1].append(name)
        used += need
    return batches


def load_to_device(
    path: str,
    names: Sequence[str],
    targets: Mapping[str, torch.Tensor],
    *,
    storage_options: Mapping[str, Any] | None = None,
    on_progress: Callable[[int], None] | None = None,
    budget: int = STAGING_BYTES,
    manifest: Manifest | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Reads tensors ``names`` of the checkpoint at ``path`` into ``targets[name]`` (same
    shape and dtype, on any device) through the staging window; returns ``(the targets
    filled, meta)``. Raises as :func:`load_checkpoint` does; a failure leaves the targets
    partly written (the caller marks the replica dirty before). The manifest is read once
    (or given), not once per batch."""
    if manifest is None:
        manifest = read_manifest(path, storage_options=storage_options)
    sizes = {n: targets[n].numel() * targets[n].element_size() for n in names}
    batches = plan_batches(sizes, budget)
    pinned = torch.cuda.is_available()
    window = torch.empty(0, dtype=torch.uint8)
    for batch in batches:
        need = sum(_aligned(sizes[n]) for n in batch)
        if window.numel() < need:
            window = torch.empty(need, dtype=torch.uint8, pin_memory=pinned)
        views: dict[str, torch.Tensor] = {}
        offset = 0
        for name in batch:
            t = targets[name]
            views[name] = window[offset : offset + sizes[name]].view(t.dtype).view(t.shape)
            offset += _aligned(sizes[name])
        got, _ = load_checkpoint(path, names=batch, storage_options=storage_options,
                                 into=views, on_progress=on_progress, manifest=manifest)
        with torch.no_grad():
            for name in batch:
                targets[name].copy_(got[name], non_blocking=pinned)
        if pinned and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the window is reused next: the copies out are done
    return {n: targets[n] for n in names}, dict(manifest.meta)
