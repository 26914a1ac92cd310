"""How a replica's gradient is summed over the replicas: one interface, three ways.

A step's reduction sums, over every replica, the gradient (already scaled by
``n_microbatch / global_batch``, so the sum is the global batch's mean) together
with the step's other sums: the module buffers' contributions
(:class:`planaria.worker.buffers.BufferSync`) and the run's status vector (the step's
loss, sample counts and flags, :data:`planaria.worker.run_loop.STATUS`). The
:class:`Reducer` is that seam; :func:`make_reducer` picks one of

- :class:`FlatReducer`: one all-reduce of the flat gradient buffers after the
  last backward, the status in a tail of the first fp32/fp64 buffer; on gloo an
  out-of-place ring (:mod:`planaria.worker.ring`) that leaves the rank's own sum whole;
- :class:`planaria.worker.reduce_overlapped.OverlappedReducer`: buckets of the
  same buffers reduced while the last backward runs, as DDP does;
- :class:`planaria.worker.reduce_sharded.ShardedReducer`: a sharded replica's
  (FSDP2 inside it), shard by shard across the replicas.

The transport below them is :class:`planaria.worker.collective.Collective`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from planaria.worker.collective import Collective
from planaria.worker.kept_work import GradientCopy, GradientKeptInPlace, HeldGradient
from planaria.worker.ring import RingPart, RingSum

__all__ = [
    "FP32_EXACT_COUNT",
    "STATUS_TAIL",
    "FlatGradients",
    "FlatReducer",
    "Reducer",
    "global_norm",
    "status_in_tail",
]

STATUS_TAIL = 32
"""Slots after the first fp32/fp64 gradient buffer that carry the run's status
(:data:`planaria.worker.run_loop.STATUS` and the metrics' sums) in the gradient's
all-reduce; a longer status, or a model with no such buffer, is reduced on its own, in
fp64 (see :func:`status_in_tail`)."""
_TAIL_DTYPES = (torch.float32, torch.float64)
FP32_EXACT_COUNT = 2**24
"""fp32 holds every integer up to 2**24 exactly, and not 2**24 + 1."""


class Reducer(Protocol):
    """A replica's gradient reduction across the replicas of a generation.

    Contract: every rank of the generation calls the same methods in the same order
    with the same ``extra`` and ``status`` lengths, so that every rank issues the same
    collectives. :meth:`reduce` raises as the collective does (a peer died, the group
    was interrupted); the gradient is then to be dropped (:meth:`zero`), and the next
    :meth:`start_step` disarms whatever the failed step left armed. After it returns,
    :meth:`gradients` hold the sum over the replicas, ``status`` (in place) and
    ``extra`` the sums over the ranks, and the returned norm is the same on every rank.
    """

    def gradients(self) -> list[torch.Tensor]:
        """This worker's gradient tensors (its shards in a sharded replica), made zero where
        a parameter has none: what clipping scales and what an optimizer step reads."""
        ...

    def zero(self) -> None:
        """Drops the gradient accumulated so far (a pending step that does not commit)."""
        ...

    def start_step(self) -> None:
        """A step starts: nothing armed by a step that failed part-way stays armed."""
        ...

    def before_last_backward(self, comm: Collective) -> None:
        """The step's last micro-batch's backward comes next (it may reduce as it goes)."""
        ...

    def agree_loaded(self, ok: bool) -> None:
        """After a step's load: the workers of a replica agree that each loaded its share
        (raises ``StepAborted`` on those that did when one did not). One worker: nothing."""
        ...

    def status_room(self) -> int | None:
        """The most slots a step's status may have and still ride in the collectives the
        step makes anyway (a fixed tail of the gradient's buffer); None: any length, the
        status being reduced as a tensor of its own whatever its length."""
        ...

    def reduce(
        self, comm: Collective, status: torch.Tensor | None, extra: list[torch.Tensor],
        meanwhile: Callable[[], None],
    ) -> float:
        """Sums the gradient, ``extra`` and ``status`` over the ranks (in place) and returns
        the reduced gradient's global L2 norm (NaN or inf if any element is). ``meanwhile``
        runs while the collective is in flight, if the reducer waits on one. A status that
        does not travel inside the gradient's own buffers is reduced beside ``extra``;
        ``extra`` itself (the caller's list) is left as it is."""
        ...

    def close(self) -> None:
        """Removes what the reducer installed on the model (hooks)."""
        ...

    def gradient_copy(self) -> HeldGradient | None:
        """The copy of this rank's own gradient sum taken as each region's reduction
        starts (:mod:`planaria.worker.kept_work`); None: this reducer keeps none."""
        ...


def status_in_tail(tail: torch.Tensor | None, status_len: int, global_batch_size: int) -> bool:
    """Whether a step's status may ride in the gradient buffer's ``tail`` (its dtype: the
    gradient's): it must fit, and its sample count must stay exact. Every partial sum of
    the ranks' counts is at most the global batch, so an fp32 tail is exact for a global
    batch below 2**24; a larger one sends the status beside the gradient, in fp64 (exact
    to 2**53). Loss and metric sums in an fp32 tail are good to ~1e-7 relative."""
    if tail is None or status_len > len(tail):
        return False
    return tail.dtype == torch.float64 or global_batch_size < FP32_EXACT_COUNT


def global_norm(buffers: list[torch.Tensor]) -> float:
    """The L2 norm of all the buffers together (NaN or inf if any element is). A float32
    or float64 buffer's square sum is its dot product with itself, a third of
    ``vector_norm``'s time on a CPU (BLAS); a half-precision one is summed in float32."""
    if not buffers:
        return 0.0
    squares = [
        b.dot(b).double() if b.dtype in (torch.float32, torch.float64)
        else torch.linalg.vector_norm(b.float()).double().square()
        for b in buffers
    ]
    return float(torch.stack(squares).sum().sqrt())


class FlatGradients:
    """Every parameter's ``.grad`` a view into one flat buffer per dtype.

    Backward accumulates straight into the buffers, which are then reduced whole: no
    copy in or out (what DDP calls gradient_as_bucket_view). The first fp32/fp64 buffer
    has :data:`STATUS_TAIL` more slots, where the run's status rides.
    """

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device, *,
                 attach: bool = True) -> None:
        """``attach``: the parameters' ``.grad`` become the views now (:meth:`attach`)."""
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        self.device = device
        self.layout = list(by_dtype.values())  # the parameters of each buffer, in order
        self.buffers: list[torch.Tensor] = []  # the gradients, one flat view per dtype
        self.reduced: list[torch.Tensor] = []  # what the all-reduce sums: those and the tail
        self.views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.tail: torch.Tensor | None = None
        for dtype, group in by_dtype.items():
            numel = sum(p.numel() for p in group)
            # The run's status rides on the gradient's own all-reduce in a tail of the
            # first fp32/fp64 buffer: one collective a step, not two.
            tail = STATUS_TAIL if self.tail is None and dtype in _TAIL_DTYPES else 0
            flat = torch.zeros(numel + tail, dtype=dtype, device=device)
            offset = 0
            for p in group:
                self.views.append((p, flat[offset : offset + p.numel()].view_as(p)))
                offset += p.numel()
            self.buffers.append(flat[:numel])
            self.reduced.append(flat)
            if tail:
                self.tail = flat[numel:]
        if attach:
            self.attach()

    def twin(self) -> FlatGradients:
        """Buffers of the same layout, not attached to the parameters."""
        return FlatGradients([p for group in self.layout for p in group], self.device,
                             attach=False)

    def attach(self) -> None:
        """Every parameter's ``.grad`` becomes its view into these buffers."""
        for p, view in self.views:
            p.grad = view

    def zero(self) -> None:
        for flat in self.buffers:
            flat.zero_()


class FlatReducer:
    """The whole flat buffers in one all-reduce after the last backward (see the module doc);
    the step's status in the first fp32/fp64 buffer's tail when it fits exactly."""

    def __init__(self, grads: FlatGradients, global_batch_size: int, *,
                 keep: bool = True, out_of_place: bool = False) -> None:
        """``keep``: this rank's own gradient sum survives a failed reduction
        (:meth:`gradient_copy`). ``out_of_place`` (gloo): the sum goes into a second set of
        buffers (:mod:`planaria.worker.ring`), the own sum left whole in the buffers, where
        a failed step's is kept (nothing copied); otherwise the in-place all-reduce, and
        with ``keep`` a copy of the gradient before it."""
        self.grads = grads
        self.global_batch_size = global_batch_size
        self.out_of_place = out_of_place
        self.copy: HeldGradient | None = None
        if keep:
            self.copy = (GradientKeptInPlace(grads.buffers) if out_of_place
                         else GradientCopy(grads.buffers))
        self._sums: FlatGradients | None = None  # where the ring writes (and receives) the sum
        self._ring: RingSum | None = None  # the last (its thread outlives one left on an abort)
        self._summed = False  # the parameters' .grad are views of the sums
        if out_of_place:  # allocated and touched here, not in a joiner's first step
            self._ring_buffers()

    def gradients(self) -> list[torch.Tensor]:
        if self._summed:
            assert self._sums is not None
            return self._sums.buffers
        return self.grads.buffers

    def zero(self) -> None:
        if self.copy is None or not self.copy.holding:  # held: kept until resumed or armed
            self.grads.zero()
        if self._summed:  # the next step accumulates into the own buffers again
            self.grads.attach()
            self._summed = False

    def start_step(self) -> None:
        pass

    def before_last_backward(self, comm: Collective) -> None:
        pass

    def agree_loaded(self, ok: bool) -> None:
        pass

    def status_room(self) -> int | None:
        tail = self.grads.tail
        if tail is None or not status_in_tail(tail, 0, self.global_batch_size):
            return None  # the status goes beside the gradient, on its own
        return len(tail)

    def reduce(
        self, comm: Collective, status: torch.Tensor | None, extra: list[torch.Tensor],
        meanwhile: Callable[[], None],
    ) -> float:
        tail = self.grads.tail
        if tail is not None:
            tail.zero_()  # reduced with the gradient every step: last step's sums must go
        in_tail = status is not None and status_in_tail(tail, len(status),
                                                        self.global_batch_size)
        if in_tail:
            assert status is not None and tail is not None
            tail[: len(status)].copy_(status)
        beside = [status] if status is not None and not in_tail else []
        if self.out_of_place and comm.world_size > 1:
            return self._reduce_out_of_place(comm, status, extra + beside, in_tail,
                                             meanwhile)
        if self.copy is not None and comm.world_size > 1:  # a peer may break it half way
            self.copy.save_all()
        works = comm.allreduce_start(self.grads.reduced + extra + beside)
        meanwhile()
        comm.wait_all(works)
        if in_tail:
            assert status is not None and tail is not None
            status.copy_(tail[: len(status)])
        # The reduced gradient is the same on every rank: its norm tells every rank (and
        # the controller) whether the update is finite, and serves the clipping at apply.
        return global_norm(self.grads.buffers)

    def _reduce_out_of_place(
        self, comm: Collective, status: torch.Tensor | None, small: list[torch.Tensor],
        in_tail: bool, meanwhile: Callable[[], None],
    ) -> float:
        """The ring sums the buffers into :attr:`_sums` (and their norm on the way); the
        small tensors are all-reduced after it. The parameters' ``.grad`` then view the
        sums, until :meth:`zero`."""
        sums = self._ring_buffers()
        parts = [RingPart(src, dst, own.numel()) for src, dst, own in
                 zip(self.grads.reduced, sums.reduced, self.grads.buffers, strict=True)]
        works = comm.ring_sum_start(parts)
        self._ring = ring = works[0]
        meanwhile()
        comm.wait_all(works)
        if small:
            comm.allreduce_sum(small)
        if in_tail:
            assert status is not None and sums.tail is not None
            status.copy_(sums.tail[: len(status)])
        sums.attach()
        self._summed = True
        return math.sqrt(ring.square_sum)  # NaN or inf where an element is

    def _ring_buffers(self) -> FlatGradients:
        """The sums' buffers, allocated at the first ring, and again where a ring left on an
        abort may still write into the last ones."""
        if self._ring is not None and self._ring.running():
            self._sums = None  # the old ones stay with that ring's thread
        if self._sums is None:
            self._sums = self.grads.twin()
        return self._sums

    def close(self) -> None:
        pass

    def gradient_copy(self) -> HeldGradient | None:
        return self.copy
