"""Every rank's step times, carried to rank 0 in the step's own status: no collective, call
or lock of their own.

The status vector (:data:`planaria.worker.run_loop.STATUS` and the metrics' sums) is
summed over the ranks in the gradient's all-reduce. After it come ``4 * per_step``
slots, zero but where a rank writes its own times, so the sum holds every rank's:

- ``[0, C)``: the load time of step ``s`` of the page's ranks (``C = per_step``);
- ``[C, 2C)``: their compute time of step ``s``;
- ``[2C, 3C)``: the reduce-wait of step ``s - 1`` of the previous step's page's ranks
  (known only once that reduction ended);
- ``[3C, 4C)``: their apply time of step ``s - 1``.

Rank 0 puts a step's load and compute in its record, and the reduce-wait and apply in
the previous step's record before it publishes it (see
:class:`planaria.worker.run_loop.StepStream`); a run's last step has none.

When the status rides in the gradient buffer's fixed tail
(:meth:`planaria.worker.reduce.Reducer.status_room`), the slots must fit there: a step
carries a page of ``C`` ranks (the page turns each step, so every rank's times come every
``ceil(width / C)`` steps); otherwise (the status is reduced on its own) all of them. A
sharded replica's workers each write their time over ``k``: the rank's slot holds their
mean. The vector's length is fixed for a run (a width change starts another run).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from planaria.wire.reports import RankTimes

__all__ = ["RankSlots"]


class RankSlots:
    """The layout of the ranks' times after the first ``offset`` slots of the status (see the
    module doc)."""

    def __init__(self, *, offset: int, width: int, room: int | None) -> None:
        """``room``: the most slots the status may take in the collectives a step makes
        anyway (None: any number)."""
        free = None if room is None or offset > room else room - offset
        self.offset, self.width = offset, width
        self.per_step = width if free is None else min(width, free // 4)
        self.pages = math.ceil(width / self.per_step) if self.per_step else 0
        self.cells: Any = None
        """The status as written: a NumPy view of a host one, else the tensor (new_status)."""

    def new_status(self, device: torch.device) -> torch.Tensor:
        """The run's status vector, zero (fp64, :attr:`length` slots); a host one is written
        through a NumPy view of it (a tensor's item assignment costs microseconds)."""
        status = torch.zeros(self.length, dtype=torch.float64, device=device)
        self.cells = status.numpy() if status.device.type == "cpu" else status
        return status

    @property
    def length(self) -> int:
        """The status's length: ``offset`` and the ranks' slots."""
        return self.offset + 4 * self.per_step

    def first(self, step: int) -> int:
        """The first rank of step ``step``'s page."""
        return (step % self.pages) * self.per_step if self.pages else 0

    def slot(self, step: int, rank: int) -> int:
        """``rank``'s load slot in step ``step``'s status; -1 if the step does not carry it."""
        if not self.pages:
            return -1
        i = rank - self.first(step)
        return self.offset + i if 0 <= i < self.per_step else -1

    def write_own(self, step: int, rank: int, load_s: float, compute_s: float) -> None:
        """This rank's load and compute times of step ``step`` into the status."""
        at = self.slot(step, rank)
        if at >= 0:
            self.cells[at] = load_s
            self.cells[at + self.per_step] = compute_s

    def write_previous(self, step: int, rank: int, reduce_wait_s: float, apply_s: float
                       ) -> None:
        """This rank's reduce-wait and apply times of step ``step - 1`` into step ``step``'s
        status."""
        at = self.slot(step - 1, rank)
        if at >= 0:
            self.cells[at + 2 * self.per_step] = reduce_wait_s
            self.cells[at + 3 * self.per_step] = apply_s

    def read(self, values: list[float], step: int) -> RankTimes | None:
        """Step ``step``'s times as its reduced status (``values``) holds them: the load and
        compute of its page's ranks, their reduce-wait and apply not known yet."""
        if not self.pages:
            return None
        first = self.first(step)
        n, o, c = min(self.per_step, self.width - first), self.offset, self.per_step
        unknown = (math.nan,) * n
        return RankTimes(first=first, load=tuple(values[o : o + n]),
                         compute=tuple(values[o + c : o + c + n]), reduce_wait=unknown,
                         apply=unknown)

    def complete(self, times: RankTimes, values: list[float]) -> RankTimes:
        """The previous step's ``times`` with their reduce-wait and apply, off the next step's
        reduced status (``values``)."""
        n, o, c = len(times.load), self.offset, self.per_step
        return RankTimes(first=times.first, load=times.load, compute=times.compute,
                         reduce_wait=tuple(values[o + 2 * c : o + 2 * c + n]),
                         apply=tuple(values[o + 3 * c : o + 3 * c + n]))
