"""Module buffers (BatchNorm running statistics) as part of a step's pending update.

Each rank's forward passes change its buffers with its own micro-batches only.
At the end of a step every rank adds a *contribution* per buffer to the
step's gradient all-reduce (no extra collective); the sum gives the buffers'
new value, identical on every rank, which is applied with the optimizer update
when the step commits. A step that does not commit puts the buffers back as
they were before it. The rules, with r0 the committed value, local_r rank r's
value after its micro-batches and W the width:

- BatchNorm running statistics (``running_mean``, ``running_var`` of a
  ``_BatchNorm`` with a ``momentum``): the exponential moving average composed
  across ranks in micro-batch order, i.e. exactly the value one replica would
  have after running the whole global batch's micro-batches in order (up to
  float rounding). Each rank knows its micro-batches' place in the global batch
  and how often the module ran (its ``num_batches_tracked`` increase).
- Integer buffers (``num_batches_tracked``): r0 plus the sum of every rank's
  increase, so the count is the global batch's.
- Every other floating buffer: r0 plus the mean of the ranks' changes (the mean
  of local_r); a buffer nobody changed stays bit-identical.

At width 1 the buffers are left exactly as the forward passes made them. In a
sharded replica (FSDP2 leaves buffers whole on each worker) every worker is a rank
here, with its own micro-batches: the contributions are summed over the replicas
and then inside the replica, and a worker's weightless padding forward leaves the
buffers as they were.
Non-persistent buffers (masks, caches) are not training state: they are not in
the state dict, not sent to joiners nor saved, and are left alone here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["BufferSync"]

_EMA_NAMES = ("running_mean", "running_var")


@dataclass
class _Entry:
    module: nn.Module
    attr: str
    before: torch.Tensor
    ema_momentum: float | None  # set for BatchNorm running statistics
    counter: torch.Tensor | None  # the BatchNorm's num_batches_tracked, before the step


class BufferSync:
    """Snapshots buffers at step start, reduces them with the gradient, applies at commit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._entries: list[_Entry] = []
        self._new: list[torch.Tensor] | None = None

    @property
    def active(self) -> bool:
        return bool(self._entries)

    def begin(self) -> None:
        """Before a step's first forward: remember the committed buffers."""
        self._new = None
        entries = []
        for module in self.model.modules():
            for attr, buf in module._buffers.items():
                if buf is None or attr in module._non_persistent_buffers_set:
                    continue  # not training state: not in the state dict, never sent or saved
                momentum: Any = getattr(module, "momentum", None)
                is_ema = (
                    isinstance(module, nn.modules.batchnorm._BatchNorm)
                    and attr in _EMA_NAMES
                    and momentum is not None
                    and getattr(module, "num_batches_tracked", None) is not None
                )
                counter = module._buffers["num_batches_tracked"] if is_ema else None
                entries.append(
                    _Entry(
                        module,
                        attr,
                        buf.detach().clone(),
                        float(momentum) if is_ema else None,
                        counter.detach().clone() if counter is not None else None,
                    )
                )
        self._entries = entries

    def committed(self) -> dict[str, torch.Tensor] | None:
        """While a step is begun and not committed or rolled back: the committed value of
        every buffer it tracks, by state-dict name (the live ones are the step's, in
        flux); None otherwise (the live buffers are the committed ones)."""
        if not self._entries:
            return None
        names = {id(m): prefix for prefix, m in self.model.named_modules()}
        return {(f"{names[id(e.module)]}.{e.attr}" if names[id(e.module)] else e.attr): e.before
                for e in self._entries}

    def contributions(
        self, *, rank: int, width: int, first: int, count: int, total: int
    ) -> list[torch.Tensor]:
        """This rank's flat contributions (one float64, one int64), to be summed over ranks.

        ``first`` and ``count`` are this rank's micro-batches in the global
        batch of ``total``. Empty at width 1 or without buffers.
        """
        if width == 1 or not self._entries:
            return []
        floats: list[torch.Tensor] = []
        ints: list[torch.Tensor] = []
        for e in self._entries:
            local = e.module._buffers[e.attr]
            assert local is not None
            if not local.is_floating_point():
                ints.append((local.to(torch.int64) - e.before.to(torch.int64)).view(-1))
                continue
            now, was = local.detach().double().view(-1), e.before.double().view(-1)
            if e.ema_momentum is None:
                changed = torch.where(now == was, torch.zeros_like(now), now - was)
                floats.append(changed / width)
                continue
            counter = e.module._buffers["num_batches_tracked"]
            assert counter is not None and e.counter is not None
            runs = int(counter) - int(e.counter)  # how often it ran on this rank
            per_mb = runs / count if count else 0.0
            d = 1.0 - e.ema_momentum
            x = (
                d ** (per_mb * (total - first - count)) * (now - d**runs * was)
                if count
                else torch.zeros_like(now)
            )
            if rank == 0:  # the committed value's decay over the whole global batch
                x = x + (d ** (per_mb * total) - 1.0) * was
            floats.append(x)
        out = []
        if floats:
            out.append(torch.cat(floats))
        if ints:
            out.append(torch.cat(ints))
        return out

    def reduced(self, flats: list[torch.Tensor]) -> None:
        """After the all-reduce: the buffers' new values, kept until the step commits."""
        if not flats:  # width 1: what the forward passes left
            self._new = [self._live(e).detach().clone() for e in self._entries]
            return
        sums = iter(flats)
        float_sum = next(sums) if any(e.before.is_floating_point() for e in self._entries) else None
        int_sum = next(sums, None)
        new: list[torch.Tensor] = []
        f_off = i_off = 0
        for e in self._entries:
            n = e.before.numel()
            if e.before.is_floating_point():
                assert float_sum is not None
                delta = float_sum[f_off : f_off + n].view_as(e.before)
                f_off += n
                value = torch.where(delta == 0, e.before.double(), e.before.double() + delta)
            else:
                assert int_sum is not None
                delta = int_sum[i_off : i_off + n].view_as(e.before)
                i_off += n
                value = e.before.to(torch.int64) + delta
            new.append(value.to(e.before.dtype))
        self._new = new

    def hold(self) -> list[torch.Tensor] | None:
        """The live buffers' values now (None without buffers), for :meth:`put_back`: a
        sharded replica's worker pads with a weightless forward that must not count."""
        if not self._entries:
            return None
        return [self._live(e).detach().clone() for e in self._entries]

    def put_back(self, values: list[torch.Tensor]) -> None:
        """The live buffers as :meth:`hold` found them."""
        self._write(values)

    def commit(self) -> None:
        """The step committed: the reduced values become the buffers."""
        values = self._new if self._new is not None else [e.before for e in self._entries]
        self._write(values)
        self._entries, self._new = [], None

    def rollback(self) -> None:
        """The step did not commit: the buffers go back to their committed values."""
        self._write([e.before for e in self._entries])
        self._entries, self._new = [], None

    def _write(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for e, value in zip(self._entries, values, strict=True):
                self._live(e).copy_(value)

    @staticmethod
    def _live(e: _Entry) -> torch.Tensor:
        live = e.module._buffers[e.attr]
        assert live is not None
        return live
