"""The gradient all-reduce overlapped with the last micro-batch's backward, as DDP does.

The gradients live in one flat buffer per dtype (every ``param.grad`` is a
view into it). The buffers are cut into buckets of about ``bucket_bytes``,
each a contiguous slice holding parameters in reverse registration order, the
order in which backward produces their gradients. During the last micro-batch
(the earlier ones only accumulate), a post-accumulate-grad hook counts each
bucket's parameters down; a complete bucket starts its all-reduce at once,
asynchronously, while backward goes on with the layers below. Buckets start in
bucket order on every rank whatever order the hooks fire in (a ready bucket
waits for the ones before it), so every rank issues the same collectives in
the same order. Parameters that got no gradient leave their buckets
incomplete: :meth:`GradientBuckets.finish` starts what is left, in order,
and waits for every bucket. The update is applied only after that, so the
commit protocol is unchanged. :class:`OverlappedReducer` is this as a
:class:`planaria.worker.reduce.Reducer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from planaria.worker.collective import Collective
from planaria.worker.kept_work import GradientCopy, HeldGradient
from planaria.worker.reduce import FlatGradients, FlatReducer, global_norm

__all__ = ["BUCKET_BYTES", "GradientBuckets", "OverlappedReducer"]

#: About this many bytes per bucket (DDP's default bucket_cap_mb is 25).
BUCKET_BYTES = 25 << 20


class GradientBuckets:
    """Buckets of the flat gradient buffers, reduced as backward completes them."""

    def __init__(
        self,
        buffers: Sequence[torch.Tensor],
        layout: Sequence[Sequence[torch.nn.Parameter]],
        *,
        bucket_bytes: int = BUCKET_BYTES,
        keep: bool = False,
    ) -> None:
        """``buffers[i]`` holds the gradients of ``layout[i]``'s parameters, in that order;
        ``keep``: each bucket is copied just before its all-reduce starts (``copy``)."""
        self.buckets: list[torch.Tensor] = []
        places: list[tuple[int, int, int]] = []  # each bucket's (buffer, start, end)
        self._owner: dict[int, int] = {}  # id(param) -> bucket
        sizes: list[int] = []
        for index, (flat, params) in enumerate(zip(buffers, layout, strict=True)):
            end = flat.numel()
            start = end
            count = 0
            for p in reversed(params):
                if p.numel() == 0:
                    continue  # nothing to reduce; its hook is ignored
                start -= p.numel()
                self._owner[id(p)] = len(self.buckets)
                count += 1
                if (end - start) * flat.element_size() >= bucket_bytes:
                    self.buckets.append(flat[start:end])
                    places.append((index, start, end))
                    sizes.append(count)
                    end, count = start, 0
            if count:
                self.buckets.append(flat[start:end])
                places.append((index, start, end))
                sizes.append(count)
        self._sizes = sizes
        self.copy = GradientCopy(buffers, places) if keep else None
        self._left: list[int] = []
        self._ready: list[bool] = []
        self._next = 0
        self._works: list[Any] = []
        self._comm: Any = None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)
            for params in layout for p in params
        ]

    @property
    def armed(self) -> bool:
        return self._comm is not None

    def arm(self, comm: Any) -> None:
        """The next backward is the step's last: reduce its buckets as they complete."""
        self._comm = comm
        self._left = list(self._sizes)
        self._ready = [False] * len(self.buckets)
        self._next = 0
        self._works = []

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._comm is None:
            return
        b = self._owner.get(id(p))
        if b is None:
            return
        self._left[b] -= 1
        if self._left[b] == 0:
            self._ready[b] = True
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._ready[self._next]:
            if self.copy is not None:  # a peer may break the reduction half way
                self.copy.save(self._next)
            self._works += self._comm.allreduce_start([self.buckets[self._next]])
            self._next += 1

    def launch_rest(self) -> None:
        """Starts the buckets still waiting (parameters without a gradient), in order."""
        assert self._comm is not None, "launch_rest without arm"
        self._ready = [True] * len(self.buckets)
        try:
            self._launch_ready()
        except BaseException:
            self._comm, self._works = None, []
            raise

    def finish(self) -> None:
        """Starts the buckets still waiting (:meth:`launch_rest`) and waits for every
        bucket's reduction; raises as the collective does."""
        comm = self._comm
        assert comm is not None, "finish without arm"
        try:
            self.launch_rest()
            comm.wait_all(self._works)
        finally:
            self._comm, self._works = None, []

    def abandon(self) -> None:
        """Disarms, forgetting any reductions in flight (a failed step leaves it armed; its
        group is closed)."""
        self._comm, self._works = None, []

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class OverlappedReducer:
    """The flat buffers' buckets reduced during the last backward (:class:`GradientBuckets`);
    the step's other sums (buffers, status) in one all-reduce after them. Alone in its
    generation, a replica reduces as :class:`planaria.worker.reduce.FlatReducer` does."""

    def __init__(self, grads: FlatGradients, global_batch_size: int, *,
                 keep: bool = True) -> None:
        self.flat = FlatReducer(grads, global_batch_size, keep=False)  # alone: nothing to keep
        self.grads = grads
        self.buckets = GradientBuckets(grads.buffers, grads.layout, keep=keep)

    def gradients(self) -> list[torch.Tensor]:
        return self.grads.buffers

    def zero(self) -> None:
        self.grads.zero()

    def start_step(self) -> None:
        self.buckets.abandon()  # a step starts with no reduction armed (a failed one may)

    def before_last_backward(self, comm: Collective) -> None:
        if comm.world_size > 1:
            self.buckets.arm(comm)  # this backward reduces its buckets as they complete

    def agree_loaded(self, ok: bool) -> None:
        pass

    def status_room(self) -> int | None:
        return None  # the status is reduced after the buckets, as a tensor of its own

    def reduce(
        self, comm: Collective, status: torch.Tensor | None, extra: list[torch.Tensor],
        meanwhile: Callable[[], None],
    ) -> float:
        if comm.world_size == 1:
            return self.flat.reduce(comm, status, extra, meanwhile)
        if self.grads.tail is not None:
            self.grads.tail.zero_()
        buckets = self.buckets
        if not buckets.armed:  # no micro-batch here: the same buckets, the same order
            buckets.arm(comm)
        buckets.launch_rest()
        meanwhile()
        buckets.finish()  # the buckets still in flight
        comm.allreduce_sum(extra if status is None else [*extra, status])
        return global_norm(self.grads.buffers)

    def close(self) -> None:
        self.buckets.remove()

    def gradient_copy(self) -> HeldGradient | None:
        return self.buckets.copy
