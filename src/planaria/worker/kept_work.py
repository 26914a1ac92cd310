"""A failed step's finished micro-batches, kept: only the rest is computed again.

When a worker dies during step s, each survivor has finished some of its micro-batches:
their gradients are summed in its flat gradient buffers. On gloo the
:class:`~planaria.worker.reduce.FlatReducer` sums them out of place
(:mod:`planaria.worker.ring`), so they are whole after a failed reduction and kept where
they are (:class:`GradientKeptInPlace`): nothing is copied, before or after. An in-place
all-reduce (NCCL's, the overlapped reducer's buckets) broken half way leaves partial sums:
:class:`GradientCopy` copies each region of the buffers just before that region's
all-reduce starts (the whole buffers, or a bucket), into memory allocated once; both keep
the :class:`HeldGradient` contract. After the failure (``RunLoop.settle``),
:class:`KeptWork` completes the copy from the regions no reduction touched and reports
which micro-batches it holds
(:class:`~planaria.wire.reports.HeldWork`), with their loss, metric and sample sums and
what they were served. The controller resumes the step
(:mod:`planaria.control.carry_plan`): the survivor restores the copy into its buffers,
computes only the micro-batches it is given on top, and reduces as usual. Each
micro-batch is seeded by its global number, so the result equals the fault-free step up
to the order of the float sums.

Nothing is kept (the whole step is computed again, as before) where it would not be
sound: a sharded replica, a model with module buffers (BatchNorm's statistics are
composed over contiguous ranges), fp16's loss scaler, a rank stopped inside a
micro-batch, or a worker whose state moved on (it applied the step, or another state
was loaded: the held step must be its steps done).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from planaria.faults.errors import PlanariaError
from planaria.wire.reports import CarriedStep, HeldWork, Served

__all__ = ["GradientCopy", "GradientKeptInPlace", "HeldGradient", "HeldSums", "KeptWork"]


class HeldGradient(Protocol):
    """Where a failed step attempt's own gradient sum is kept until the step resumes.

    The engine calls :meth:`arm` as each attempt starts; a reducer calls :meth:`save` (or
    :meth:`save_all`) just before a region's reduction starts, and asks :attr:`holding`
    before it zeroes the buffers; :class:`KeptWork` calls :meth:`hold` after a failed
    attempt and :meth:`restore` when the step resumes. After ``hold``, ``restore`` puts
    this rank's own sum (never a partial one) back into the buffers; an attempt armed
    without a restore starts from zero buffers."""

    @property
    def holding(self) -> bool:
        """The buffers themselves hold a failed attempt's sum: the reducer must not zero them."""

    def arm(self) -> None:
        """A step attempt starts."""

    def save(self, region: int) -> None:
        """Region ``region``'s reduction starts next."""

    def save_all(self) -> None:
        """Every region's reduction starts next."""

    def hold(self) -> None:
        """After a failed reduction: keep this rank's own sum."""

    def restore(self) -> None:
        """The held sum back in the buffers (the step resumes)."""


class GradientCopy:
    """:class:`HeldGradient` for an in-place reduction: copies of regions of the flat
    gradient buffers, each taken just before the region's reduction starts in the current
    attempt (:meth:`save`); allocated once, at the first."""

    holding = False  # the buffers are the reduction's: the copy holds the sum

    def __init__(self, buffers: Sequence[torch.Tensor],
                 places: Sequence[tuple[int, int, int]] | None = None) -> None:
        """``places``: the regions as (buffer index, start, end); None: each buffer whole."""
        self.buffers = list(buffers)
        self.places = (list(places) if places is not None
                       else [(i, 0, b.numel()) for i, b in enumerate(self.buffers)])
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer's, copy's)
        self.saved = [0] * len(self.places)  # the attempt each region was last saved in
        self.attempt = 1

    def arm(self) -> None:
        """A step attempt starts: no region is saved in it yet."""
        self.attempt += 1

    def save(self, region: int) -> None:
        """Copies region ``region`` (its reduction starts next)."""
        if not self.pairs:
            self._allocate()
        live, copy = self.pairs[region]
        copy.copy_(live)
        self.saved[region] = self.attempt

    def save_all(self) -> None:
        for region in range(len(self.places)):
            self.save(region)

    def hold(self) -> None:
        """After a failed reduction: the regions no reduction started are copied too, so
        the copy holds this rank's own sum whole."""
        for region in range(len(self.places)):
            if self.saved[region] != self.attempt:
                self.save(region)

    def restore(self) -> None:
        """The copy back into the buffers."""
        for live, copy in self.pairs:
            live.copy_(copy)

    def _allocate(self) -> None:
        copies = [torch.empty_like(b) for b in self.buffers]
        self.pairs = [(self.buffers[i][a:b], copies[i][a:b]) for i, a, b in self.places]


class GradientKeptInPlace:
    """:class:`HeldGradient` for an out-of-place reduction (the ring never writes the
    buffers): after a failed one they hold this rank's own sum as they are. :meth:`hold`
    keeps them (nothing copied; :attr:`holding` tells the reducer not to zero them),
    :meth:`restore` finds them in place, and an attempt armed without a restore zeroes
    them, the drop its failed attempt left undone."""

    def __init__(self, buffers: Sequence[torch.Tensor]) -> None:
        self.buffers = list(buffers)
        self.holding = False

    def arm(self) -> None:
        if self.holding:
            self.holding = False
            for b in self.buffers:
                b.zero_()

    def save(self, region: int) -> None:
        pass  # the reduction leaves the buffers as they are

    def save_all(self) -> None:
        pass

    def hold(self) -> None:
        self.holding = True

    def restore(self) -> None:
        self.holding = False


@dataclass(frozen=True, kw_only=True, slots=True)
class HeldSums:
    """What a failed step attempt left this rank: its finished micro-batches' numbers, and
    their loss, metric and sample sums and served samples (their gradient: the copy)."""

    step: int
    micro_batches: tuple[int, ...]
    loss_sum: float
    metric_sums: Mapping[str, float]
    samples: int
    served: Served


class KeptWork:
    """This rank's progress through its current step attempt (set by the engine as it
    goes), and what a failed attempt left it (:meth:`settle`, :meth:`resume`)."""

    def __init__(self) -> None:
        self.step = -1
        self.first = 0  # the attempt's micro-batches: first .. first + count - 1,
        self.count = 0
        self.numbers: tuple[int, ...] | None = None  # or these (a resumed step's new ones)
        self.prior: HeldSums | None = None  # held from the attempt before, resumed in this one
        self.done = -1  # this attempt's micro-batches finished whole; -1: not known
        self.loss_sum = 0.0  # over prior and the finished ones
        self.metric_sums: dict[str, float] = {}
        self.counts: Sequence[tuple[int, object]] = ()  # the loaded micro-batches (n, batch)
        self.served: Served | None = None  # the attempt's, prior's first
        self.held: HeldSums | None = None

    def start(self, step: int, first: int, numbers: tuple[int, ...] | None,
              prior: HeldSums | None, copy: HeldGradient | None, count: int = 0) -> None:
        """A step attempt starts on micro-batches ``first .. first + count - 1`` (or
        ``numbers``)."""
        self.step, self.first, self.numbers, self.prior = step, first, numbers, prior
        self.count = count
        self.done, self.served, self.counts = -1, None, ()
        self.held = None
        if copy is not None:
            copy.arm()

    def reached(self, done: int, loss_sum: float, metric_sums: dict[str, float]) -> None:
        """``done`` of the attempt's micro-batches are finished whole (it stopped between
        two, or its reduction starts next); the sums are over them and the prior's."""
        self.done, self.loss_sum, self.metric_sums = done, loss_sum, metric_sums

    def resume(self, carry: CarriedStep, steps_done: int,
               copy: HeldGradient | None) -> HeldSums | None:
        """Step ``carry.step`` resumes here with ``carry.kept`` held: the held gradient goes
        back into the buffers. Returns what is held (None: nothing, ``carry.kept`` empty)."""
        if not carry.kept:
            return None
        held = self.held
        if (held is None or copy is None or held.step != carry.step
                or held.micro_batches != carry.kept or steps_done != carry.step):
            self.done, self.held = -1, None  # this attempt keeps nothing either
            raise PlanariaError(
                f"asked to resume step {carry.step} keeping micro-batches {carry.kept}, "
                f"but holds {None if held is None else (held.step, held.micro_batches)} "
                f"with {steps_done} steps done")
        copy.restore()
        return held

    def settle(self, steps_done: int, pending: int | None, copy: HeldGradient | None,
               keepable: bool) -> HeldWork | None:
        """After a failed run: what this rank holds of its failed step, if it can keep it
        (see the module doc; ``micro_batches`` empty: none finished); the copy then holds its
        gradient sum."""
        self.held = None
        if (not keepable or copy is None or self.done < 0 or pending != self.step
                or steps_done != self.step):
            return None
        done, prior = self.done, self.prior
        numbers = (self.numbers[:done] if self.numbers is not None
                   else tuple(range(self.first, self.first + done)))
        # the attempt's others, not begun (count 0: not told, none reported)
        unstarted = (self.numbers[done:] if self.numbers is not None
                     else tuple(range(self.first + done, self.first + self.count)))
        mine = tuple(prior.micro_batches if prior is not None else ()) + numbers
        if not mine:  # nothing held; what it had not begun still tells the work lost apart
            return HeldWork(step=self.step, micro_batches=(), unstarted=unstarted)
        samples = sum(n for n, _ in self.counts[:done])
        base = prior.samples if prior is not None else 0
        served = self.served
        if served is None:  # stopped before its load: only the held part
            served = prior.served if prior is not None else Served(ids=(), digests=None)
        cut = len(prior.served.ids) if prior is not None else 0
        cut += samples if self.served is not None else 0
        copy.hold()
        self.held = HeldSums(
            step=self.step, micro_batches=mine, loss_sum=self.loss_sum,
            metric_sums=dict(self.metric_sums), samples=base + samples,
            served=Served(ids=tuple(served.ids[:cut]),
                          digests=None if served.digests is None
                          else tuple(served.digests[:cut])))
        return HeldWork(step=self.step, micro_batches=mine, unstarted=unstarted)
