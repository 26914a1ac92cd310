"""The out-of-place ring all-reduce: each buffer summed over the ranks into another buffer,
the rank's own buffer only read.

Why: gloo's all-reduce works in place, so a survivor whose peer died half way through holds
partial sums. Keeping its finished micro-batches (:mod:`planaria.worker.kept_work`) then
needed a copy of the gradient before every all-reduce, a pass over the gradient a step
for a kill that lands in one step of thousands. Here the source is never written: a failed
step's own sum is intact where it is, and kept there. The ring moves the bytes
gloo's own ring moves (2 (R - 1) / R of the buffer each way) and does the same additions,
out of place.

Both phases move each chunk in segments (:data:`SEGMENT_BYTES`), as gloo's own ring does,
every receive posted up front into the part of the destination it fills (no scratch): a
segment is summed as it arrives and leaves for the next rank at once, while the rest of
its chunk is still on the wire, so adding and moving overlap instead of alternating. The
additions are the same, element for element: the sum is the same bits as unsegmented.
Measured (``bench/ring.py``: 3 gloo ranks x 84.6M floats x 1 thread on the 2-core box,
medians of 9 rounds, three runs): 395-409 ms, 1.07-1.12x gloo's in-place all-reduce;
moving whole chunks one after the other, as this ring did before, 427-443 ms, 1.18-1.22x.

The same pass yields the reduced buffer's square sum for 1/R of the work: the rank whose
chunk's sum completes squares it and sends the square sum around with the chunk, so every
rank adds the same R numbers in the same order and gets the same norm.

A recv waiting on a peer cannot be left (gloo cannot resume a timed point-to-point wait),
so the ring runs on a thread of its own and :class:`RingSum` is waited on as a c10d work
is: ``wait(timeout)`` raises c10d's timeout message when the slice passes, so that
:meth:`planaria.worker.collective.Collective.wait_all` can leave it on an interrupt. A ring
left that way may still write its destination until its peer's connection
closes: :meth:`RingSum.running` tells the owner not to reuse them meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

__all__ = ["RING_TAG", "SEGMENT_BYTES", "RingPart", "RingSum", "chunk_bounds"]

RING_TAG = 1 << 24
"""Point-to-point tags from here on are the ring's; a generation's other transfers (a state
sent to a joiner) count their tags from 0 on the same group."""
SEGMENT_BYTES = 8 << 20
"""The reduce-scatter moves a chunk in segments of this many bytes (at most
:data:`MAX_SEGMENTS` of them: a larger chunk, larger segments)."""
MAX_SEGMENTS = 64
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


class RingSum:
    """One out-of-place ring all-reduce of ``parts`` over the group ``pg``, on a thread.

    Contract: every rank starts one with parts of the same sizes and dtypes, in the same
    order. Each ``src`` is read, never written; each ``dst`` is written whole, and holds the
    sum, bit for bit the same on every rank, once :meth:`wait` returns (peers' chunks are
    received into it: no other memory).
    :attr:`square_sum` is then the sum of the squares of every ``dst[:norm_numel]``, the
    same on every rank (NaN or inf where an element is). :meth:`wait` raises the
    transport's error (a dead peer's closed connection) if the ring failed.
    """

    def __init__(self, pg: Any, rank: int, world_size: int, parts: Sequence[RingPart]
                 ) -> None:
        self.pg, self.rank, self.world_size = pg, rank, world_size
        self.parts = list(parts)
        self.segment_bytes = SEGMENT_BYTES
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
        """Whether the ring's thread may still write its destinations."""
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
        """Reduce-scatter (each rank ends with one chunk's whole sum), then all-gather, each
        pipelined by segments: a segment goes on to the next rank as soon as it is summed
        (reduce-scatter) or has arrived (all-gather), while the rest of its chunk is still
        on the wire. Every receive of a phase is posted at its start, into the chunk of
        ``dst`` it fills (they are distinct), so a peer's segments flow as soon as it sends
        them."""
        world, rank = self.world_size, self.rank
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        bounds = chunk_bounds(part.src.numel(), world)
        stride = len(self.parts) * 4 * world  # a segment's tags: tag + segment x stride
        tag = RING_TAG + index * 4 * world

        def chunk(t: torch.Tensor, c: int) -> torch.Tensor:
            return t[bounds[c] : bounds[c + 1]]

        def send_on(segment: torch.Tensor, step_tag: int, lo: int, of: torch.Tensor) -> None:
            sends.append(self.pg.send([segment], nxt,
                                      step_tag + self._segment_of(lo, of) * stride))

        # Reduce-scatter: step t receives chunk (rank - t - 1)'s partial sum into dst, adds
        # this rank's src (incoming + src: the same bits as src + incoming) and, but at
        # the last step, sends it on.
        steps = [(t, (rank - t - 1) % world) for t in range(world - 1)]
        recvs = [self._recv_segments(chunk(part.dst, c), prv, tag + t, stride)
                 for t, c in steps]
        sends = self._send_segments(chunk(part.src, rank), nxt, tag, stride)
        for (t, c), segments in zip(steps, recvs, strict=True):
            own_src, dst = chunk(part.src, c), chunk(part.dst, c)
            for lo, hi, work in segments:
                work.wait()
                dst[lo:hi].add_(own_src[lo:hi])
                if t < world - 2:
                    send_on(dst[lo:hi], tag + t + 1, lo, dst)
        for work in sends:  # the all-gather below writes chunks a send may still read
            work.wait()
        # All-gather: step t receives chunk (rank - t)'s whole sum and, but at the last
        # step, sends it on; the square sums follow their chunks (this rank's own, whole
        # here, squared while it is on the wire).
        own = (rank + 1) % world
        steps = [(t, (rank - t) % world) for t in range(world - 1)]
        recvs = [self._recv_segments(chunk(part.dst, c), prv, tag + world + t, stride)
                 for t, c in steps]
        sends = self._send_segments(chunk(part.dst, own), nxt, tag + world, stride)
        squares = torch.zeros(world, dtype=torch.float64)
        lo, hi = bounds[own], min(bounds[own + 1], part.norm_numel)
        if hi > lo:
            squares[own] = _square_sum(part.dst[lo:hi])
        for (t, c), segments in zip(steps, recvs, strict=True):
            dst = chunk(part.dst, c)
            for lo, hi, work in segments:
                work.wait()
                if t < world - 2:
                    send_on(dst[lo:hi], tag + world + t + 1, lo, dst)
            out = (rank + 1 - t) % world
            self._exchange(squares[out : out + 1], nxt, squares[c : c + 1], prv,
                           tag + 2 * world + t)
        for work in sends:
            work.wait()
        return float(squares.sum())  # in chunk order: the same on every rank

    def _segment_elements(self, t: torch.Tensor) -> int:
        """How many elements of ``t`` (a chunk) one segment holds."""
        per = max(1, self.segment_bytes // t.element_size())
        return max(per, -(-t.numel() // MAX_SEGMENTS))

    def _segment_of(self, lo: int, t: torch.Tensor) -> int:
        return lo // self._segment_elements(t)

    def _send_segments(self, out: torch.Tensor, to: int, tag: int, stride: int) -> list[Any]:
        per = self._segment_elements(out)
        return [self.pg.send([out[lo : lo + per]], to, tag + (lo // per) * stride)
                for lo in range(0, out.numel(), per)]

    def _recv_segments(self, into: torch.Tensor, source: int, tag: int, stride: int
                       ) -> list[tuple[int, int, Any]]:
        """Receives posted for every segment of ``into``, in order: (start, end, work)."""
        per, n = self._segment_elements(into), into.numel()
        return [(lo, min(lo + per, n), self.pg.recv([into[lo : lo + per]], source,
                                                    tag + (lo // per) * stride))
                for lo in range(0, n, per)]

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
