"""The out-of-place ring all-reduce: each buffer summed over the ranks into another buffer,
the rank's own buffer only read.

Why: gloo's all-reduce works in place, so a survivor whose peer died half way through holds
partial sums. Keeping its finished micro-batches (:mod:`planaria.worker.kept_work`) then
needed a copy of the gradient before every all-reduce, a pass over the gradient a step
for a kill that lands in one step of thousands. Here the source is never written: a failed
step's own sum is intact where it is, and kept there. The ring moves the bytes
gloo's own ring moves (2 (R - 1) / R of the buffer each way) and does the same additions,
out of place (3 gloo ranks x 84.6M floats x 1 thread on the 2-core box, medians of 11:
350 ms, against 325 for gloo's in-place all-reduce and 400 for a copy and that).

The same pass yields the reduced buffer's square sum for 1/R of the work: the rank whose
chunk's sum completes squares it and sends the square sum around with the chunk, so every
rank adds the same R numbers in the same order and gets the same norm.

A recv waiting on a peer cannot be left (gloo cannot resume a timed point-to-point wait),
so the ring runs on a thread of its own and :class:`RingSum` is waited on as a c10d work
is: ``wait(timeout)`` raises c10d's timeout message when the slice passes, so that
:meth:`planaria.worker.collective.Collective.wait_all` can leave it on an interrupt. A ring
left that way may still write its destination and scratch until its peer's connection
closes: :meth:`RingSum.running` tells the owner not to reuse them meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from itertools import pairwise
from typing import Any

import torch

__all__ = ["RING_TAG", "RingPart", "RingSum", "chunk_bounds", "scratch_bytes"]

RING_TAG = 1 << 24
"""Point-to-point tags from here on are the ring's; a generation's other transfers (a state
sent to a joiner) count their tags from 0 on the same group."""
SLICE_EXPIRED = "Operation timed out!"  # what a c10d work's wait says when its timeout passes


@dataclass(frozen=True, slots=True)
class RingPart:
    """One buffer of a ring: ``dst`` gets the sum of every rank's ``src`` (same size and
    dtype); the square sum covers ``dst[:norm_numel]`` (a tail past it is not gradient)."""

    src: torch.Tensor
    dst: torch.Tensor
    norm_numel: int


def chunk_bounds(numel: int, world_size: int) -> list[int]:
    """Where the buffer's ``world_size`` chunks start (and the last ends)."""
    return [numel * i // world_size for i in range(world_size + 1)]


def scratch_bytes(buffers: Sequence[torch.Tensor], world_size: int) -> int:
    """The scratch a ring of ``buffers`` over ``world_size`` ranks needs: its largest chunk,
    in bytes."""
    return max((b - a) * t.element_size() for t in buffers
               for a, b in pairwise(chunk_bounds(t.numel(), world_size)))


class RingSum:
    """One out-of-place ring all-reduce of ``parts`` over the group ``pg``, on a thread.

    Contract: every rank starts one with parts of the same sizes and dtypes, in the same
    order. Each ``src`` is read, never written; each ``dst`` is written whole, and holds the
    sum, bit for bit the same on every rank, once :meth:`wait` returns; ``scratch`` (bytes,
    1-D ``torch.uint8``, at least :func:`scratch_bytes` of the sources)
    receives peers' chunks.
    :attr:`square_sum` is then the sum of the squares of every ``dst[:norm_numel]``, the
    same on every rank (NaN or inf where an element is). :meth:`wait` raises the
    transport's error (a dead peer's closed connection) if the ring failed.
    """

    def __init__(self, pg: Any, rank: int, world_size: int, parts: Sequence[RingPart],
                 scratch: torch.Tensor) -> None:
        self.pg, self.rank, self.world_size = pg, rank, world_size
        self.parts, self.scratch = list(parts), scratch
        self.square_sum = 0.0
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="planaria-ring", daemon=True)
        self._thread.start()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits for the ring (for ``timeout`` at most: then raises c10d's timeout message,
        the ring going on); raises the ring's error if it failed."""
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(SLICE_EXPIRED)
        if self._error is not None:
            raise self._error
        return True

    def running(self) -> bool:
        """Whether the ring's thread may still write its destinations and scratch."""
        return not self._done.is_set()

    def _run(self) -> None:
        try:
            squares = [self._ring(i, part) for i, part in enumerate(self.parts)]
            self.square_sum = float(sum(squares))
        except BaseException as err:  # handed to wait()
            self._error = err
        finally:
            self._done.set()

    def _ring(self, index: int, part: RingPart) -> float:
        """Reduce-scatter (each rank ends with one chunk's whole sum), then all-gather."""
        world, rank = self.world_size, self.rank
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        bounds = chunk_bounds(part.src.numel(), world)
        tag = RING_TAG + index * 4 * world

        def chunk(t: torch.Tensor, c: int) -> torch.Tensor:
            return t[bounds[c] : bounds[c + 1]]

        for t in range(world - 1):
            out, into = (rank - t) % world, (rank - t - 1) % world
            size = (bounds[into + 1] - bounds[into]) * part.dst.element_size()
            incoming = self.scratch[:size].view(part.dst.dtype)
            self._exchange(chunk(part.src if t == 0 else part.dst, out), nxt,
                           incoming, prv, tag + t)
            torch.add(chunk(part.src, into), incoming, out=chunk(part.dst, into))
        own = (rank + 1) % world  # its sum is whole here: its square sum goes around with it
        squares = torch.zeros(world, dtype=torch.float64)
        lo, hi = bounds[own], min(bounds[own + 1], part.norm_numel)
        if hi > lo:
            squares[own] = _square_sum(part.dst[lo:hi])
        for t in range(world - 1):
            out, into = (rank + 1 - t) % world, (rank - t) % world
            self._exchange(chunk(part.dst, out), nxt, chunk(part.dst, into), prv,
                           tag + world + t)
            self._exchange(squares[out : out + 1], nxt, squares[into : into + 1], prv,
                           tag + 2 * world + t)
        return float(squares.sum())  # in chunk order: the same on every rank

    def _exchange(self, out: torch.Tensor, to: int, into: torch.Tensor, source: int,
                  tag: int) -> None:
        """Sends ``out`` to ``to`` while receiving ``into`` from ``source`` (an empty chunk of a
        buffer smaller than the ring is neither sent nor received, on both sides)."""
        works = []
        if out.numel():
            works.append(self.pg.send([out], to, tag))
        if into.numel():
            works.append(self.pg.recv([into], source, tag))
        for work in reversed(works):  # the receive first: it is what the next step needs
            work.wait()


def _square_sum(t: torch.Tensor) -> float:
    """The sum of the squares (float32 and float64 as a dot product: BLAS; others in float32)."""
    if t.dtype in (torch.float32, torch.float64):
        return float(t.dot(t).double())
    return float(torch.linalg.vector_norm(t.float()).double().square())
