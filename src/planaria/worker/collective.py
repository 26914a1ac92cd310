"""One generation's process group, built directly on the controller's TCPStore.

Each generation gets its own group under the store prefix ``gen<g>/``; groups
are plain objects (no torch.distributed global state), so a worker can drop a
broken group and build the next one without tearing anything else down.

Devices: NCCL moves CUDA tensors, gloo host tensors (gloo's all-reduce also
takes CUDA tensors, staging them itself). A point-to-point transfer or a
broadcast of a tensor that lives elsewhere (Adam's ``step`` counters stay on the
host beside CUDA parameters; a restore reads into host memory; workers sharing
one GPU talk over gloo) is staged chunk by chunk through a bounded pool of
buffers on the group's device (pinned host memory for gloo), never a whole
extra copy of the state.

A rank waiting in a collective can be told to leave it (:meth:`Collective.interrupt`,
from another thread: the controller's abort when a peer failed). The wait does not
rest on the transport noticing a dead peer: a gloo all-reduce is waited for in
slices, with a look at the interrupt between them; a closed gloo group is released
on a thread of its own, since its destructor joins threads that may still wait on
the peer.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from planaria.wire import store_keys
from planaria.worker.ring import SLICE_EXPIRED, RingPart, RingSum

__all__ = ["Collective", "connect_store"]

CHUNK_BYTES = 32 << 20  # big sends in chunks: gloo moves 8 chunks ~10x faster than one cold call
WINDOW = 8  # chunks of a transfer in flight at once (256 MB): progress is reported between
STAGING_SLOTS = 4  # chunks of another device's tensor in flight at once (4 x 32 MB staged)
PRESENCE_POLL_S = 0.1  # how often a rank waiting for its peers looks at the abort key
PRESENCE_FAST_S = 0.05
"""For this long a rank waiting for its peers looks every millisecond (every
``world_size / 16`` ms in a wide group, so the store serves ~16 looks per ms), then backs
off to :data:`PRESENCE_POLL_S`. Survivors of a kill arrive within milliseconds of each
other: a backoff from the start (5, 10, 20 ms) kept the first one waiting up to 6 ms after
the last had arrived (medium model, 3 replicas: a third of the group's build)."""
WAIT_SLICE_S = 0.01
"""How often a rank waiting in a gloo collective looks at its interrupt; the transport's own
error (a dead peer's closed connection) also surfaces only at a slice's end. At 50 ms a
survivor of a SIGKILL answered up to 50 ms after it could have (medium model, 3 replicas:
the kill's whole critical path is ~140 ms). A slice that expires costs ~0.4 ms of CPU
(c10d raises its timeout; measured on the 2-core machine, in a bare process and in one with
a worker's libraries loaded): ~4 % of a core while a rank waits, twice that at 5 ms."""
WAIT_SLICE = timedelta(seconds=WAIT_SLICE_S)


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the controller's TCPStore."""
    return dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


class Collective:
    """The process group of one generation, for one rank."""

    def __init__(
        self,
        store: dist.Store,
        gen: int,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        join_timeout_s: float = 60.0,
        timeout_s: float = 300.0,
        tag: str = "",
    ) -> None:
        """``tag`` names one of a generation's groups where it has several (the shard
        indices' groups of sharded replicas, see planaria.worker.sharded)."""
        self.gen = gen
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        # Where this group's transfers live: NCCL's on the GPU, gloo's in (pinned) host memory.
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        self._staging: list[torch.Tensor] = []
        self._interrupted = False  # set from another thread (interrupt)
        self._closed_by: BaseException | None = None  # the failure that closed the group
        prefixed = dist.PrefixStore(store_keys.group_prefix(gen, tag), store)
        _wait_for_peers(store, prefixed, gen, rank, world_size, join_timeout_s)
        self.pg: Any
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=timeout_s)
            # Non-blocking communicators: a hung collective can be aborted from another
            # thread (close) instead of holding the host thread inside NCCL.
            with contextlib.suppress(AttributeError):
                opts.config.blocking = 0
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(
                prefixed, rank, world_size, timedelta(seconds=join_timeout_s)
            )
            # The join deadline only bounds the rendezvous; collectives get their own.
            self.pg.set_timeout(timedelta(seconds=timeout_s))

    def allreduce_sum(self, tensors: list[torch.Tensor]) -> None:
        """Sums each tensor over the ranks, in place."""
        self.wait_all(self.allreduce_start(tensors))

    def allreduce_start(self, tensors: list[torch.Tensor]) -> list[Any]:
        """Starts summing each tensor over the ranks, in place; :meth:`wait_all` waits. On
        an error the group is closed (as in :meth:`allreduce_sum`)."""
        if self.world_size == 1:
            return []
        return self._start(lambda pg: [pg.allreduce([t]) for t in tensors])

    def ring_sum_start(self, parts: Sequence[RingPart]) -> list[Any]:
        """Starts summing each part's ``src`` over the ranks into its ``dst``, out of place
        (:class:`planaria.worker.ring.RingSum`, gloo only); :meth:`wait_all` waits, and can
        leave it on an interrupt as it leaves an all-reduce."""
        if self.backend != "gloo":
            raise ValueError(f"the out-of-place ring runs on gloo, not {self.backend}")
        return self._start(lambda pg: [RingSum(pg, self.rank, self.world_size, parts)])

    def wait_all(self, works: list[Any], *, interruptible: bool = True) -> None:
        """Waits for operations :meth:`allreduce_start` started; on an error closes the group.

        On a GPU, ``work.wait()`` only orders the current stream after NCCL's: the host
        goes on before the reduction has finished. A step must not be reported (and
        committed) before its gradient is reduced, so the host waits for the stream too.
        A gloo collective's wait ends early on :meth:`interrupt` (``interruptible``; not
        for point-to-point transfers, whose timed waits gloo cannot resume).
        """
        try:
            self._raise_if_interrupted()
            for work in works:
                if interruptible and self.backend == "gloo":
                    self._wait_interruptibly(work)
                else:
                    work.wait()
            if works:
                _sync_cuda()
        except Exception as err:
            works.clear()  # pending work holds the group's connections too
            self._close_on(err)
            raise

    def interrupt(self) -> None:
        """Makes the wait in progress, and every later one, raise StepAborted (from another
        thread: a peer failed, so the collective may never complete). A gloo wait ends
        within :data:`WAIT_SLICE_S`; an NCCL group is left to its abort (:meth:`close`)."""
        self._interrupted = True

    def _raise_if_interrupted(self) -> None:
        if self._interrupted:
            from planaria.faults.errors import StepAborted

            raise StepAborted(f"generation {self.gen}'s collective was interrupted: a peer failed")

    def _wait_interruptibly(self, work: Any) -> None:
        """``work.wait()`` in slices of :data:`WAIT_SLICE_S`, looking at the interrupt between
        them: a gloo collective's timed wait that expires leaves the operation running, and
        the next wait takes it up (as fast as one plain wait when the operation is done
        within the first slice)."""
        while True:
            try:
                work.wait(timeout=WAIT_SLICE)
                return
            except RuntimeError as err:
                if SLICE_EXPIRED not in str(err):
                    raise  # the operation's own error (its own timeout included)
            # The slice expired (the operation may have ended just after: the next wait
            # returns at once, or raises the operation's error).
            self._raise_if_interrupted()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcasts a contiguous tensor from rank ``src`` into every rank's ``tensor``."""
        if self.world_size == 1:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._transfer(
            tensor, lambda pg, c, i: pg.broadcast([c], opts),
            stage_in=self.rank == src, stage_out=self.rank != src,
        )

    def send(self, tensors: list[torch.Tensor], dst: int,
             on_progress: Any = None, *, first_tag: int = 0) -> int:
        """Sends contiguous tensors to ``dst`` in chunks, a window of them in flight at a
        time; ``on_progress(nbytes)`` after each window (a transfer that moves bytes is
        busy, however long it takes: see planaria.control.liveness). Returns the tag after
        the last chunk's (chunk tags count on from ``first_tag``)."""
        return self._transfer_all(tensors, lambda pg, c, i: pg.send([c], dst, i), True,
                                  False, on_progress, first_tag)

    def recv(self, tensors: list[torch.Tensor], src: int,
             on_progress: Any = None, *, first_tag: int = 0) -> int:
        """Receives what :meth:`send` sent, into contiguous tensors of the same layout; one
        send may be received in several calls, each from the tag the last returned."""
        return self._transfer_all(tensors, lambda pg, c, i: pg.recv([c], src, i), False,
                                  True, on_progress, first_tag)

    def _transfer_all(
        self, tensors: list[torch.Tensor], op: Any, stage_in: bool, stage_out: bool,
        on_progress: Any = None, first_tag: int = 0,
    ) -> int:
        """Tensors on the group's device go :data:`WINDOW` chunks at a time; the others are
        staged (below). Chunk tags count on over the whole call from ``first_tag``, as the
        peer's do; returns the next tag."""
        if all(self._native(t) for t in tensors):
            chunks = [c for t in tensors for c in _chunks(t)]
            for start in range(0, len(chunks), WINDOW):
                window = chunks[start : start + WINDOW]
                self._run(lambda pg, w=window, f=first_tag + start: [
                    op(pg, c, f + i) for i, c in enumerate(w)])
                if on_progress is not None:
                    on_progress(sum(c.numel() * c.element_size() for c in window))
            return first_tag + len(chunks)
        tag = first_tag
        for t in tensors:
            tag = self._transfer(t, op, stage_in=stage_in, stage_out=stage_out, tag=tag)
            if on_progress is not None:
                on_progress(t.numel() * t.element_size())
        return tag

    def _native(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.device.type

    def _transfer(
        self, tensor: torch.Tensor, op: Any, *, stage_in: bool, stage_out: bool, tag: int = 0
    ) -> int:
        """``op(pg, chunk, tag)`` over ``tensor``'s chunks; returns the next tag.

        A tensor on another device goes through :data:`STAGING_SLOTS` reused staging
        buffers on the group's device: copied in before the operation where this rank
        provides the data (``stage_in``), out after it where it receives (``stage_out``).
        """
        chunks = _chunks(tensor)
        if self._native(tensor):
            self._run(lambda pg: [op(pg, c, tag + i) for i, c in enumerate(chunks)])
            return tag + len(chunks)
        for start in range(0, len(chunks), STAGING_SLOTS):
            window = chunks[start : start + STAGING_SLOTS]
            staged = [self._stage(slot, c) for slot, c in enumerate(window)]
            if stage_in:
                for buf, c in zip(staged, window, strict=True):
                    buf.copy_(c)
                _sync_cuda()  # the copies in are done before the group reads the slots
            first = tag + start
            self._run(lambda pg, s=staged, f=first: [op(pg, b, f + i) for i, b in enumerate(s)])
            if stage_out:
                for buf, c in zip(staged, window, strict=True):
                    c.copy_(buf)
                _sync_cuda()  # the slots are reused next: the copies out must be done
        return tag + len(chunks)

    def _stage(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        """Slot ``slot`` of the staging pool, viewed as ``like``'s dtype and size."""
        nbytes = like.numel() * like.element_size()
        while len(self._staging) <= slot:
            self._staging.append(torch.empty(0, dtype=torch.uint8))
        buf = self._staging[slot]
        if buf.numel() < nbytes:
            pinned = self.device.type == "cpu" and torch.cuda.is_available()
            size = max(nbytes, min(CHUNK_BYTES, 1 << 20))
            buf = torch.empty(size, dtype=torch.uint8, device=self.device, pin_memory=pinned)
            self._staging[slot] = buf
        return buf[:nbytes].view(like.dtype).view(like.shape)

    def _run(self, issue: Any) -> None:
        """Issues the operations and waits for them; on any error the group is closed.

        A failed rank must close its connections: a peer blocked waiting on data
        from it (not from the dead rank) only notices when its sockets close, and
        would otherwise wait for the whole collective timeout.
        """
        self.wait_all(self._start(issue), interruptible=False)

    def _start(self, issue: Any) -> list[Any]:
        """Issues the operations (``issue(pg)``) without waiting; on an error closes the group."""
        self._raise_if_interrupted()
        if self.pg is None:
            self._raise_closed()
        try:
            return list(issue(self.pg))
        except Exception as err:
            self._close_on(err)
            raise

    def _close_on(self, err: BaseException) -> None:
        if self._closed_by is None:
            self._closed_by = err
        self.close()

    def _raise_closed(self) -> None:
        """An operation on a group already closed: where a failed operation closed it (on
        another thread: a transfer beside the step) and that failure was a peer's, this one
        is its consequence too (StepAborted), not a cause of its own."""
        from planaria.faults.errors import StepAborted, is_consequence

        cause = self._closed_by
        message = f"the process group of generation {self.gen} was closed"
        if cause is not None and is_consequence(cause):
            raise StepAborted(f"{message} after a peer failed: {cause}") from cause
        raise RuntimeError(message if cause is None else f"{message} after: {cause}")

    def close(self) -> None:
        """Shuts the group down and drops it, which closes its sockets.

        An NCCL group is aborted, not shut down: a clean shutdown waits for the
        collectives in flight, which never end when a peer died mid-ring.
        """
        pg, self.pg = self.pg, None
        self._staging = []
        if pg is None:
            return
        # A group whose peer died may refuse a clean shutdown.
        with contextlib.suppress(Exception):
            if self.backend == "nccl":
                pg.abort()
            else:
                pg.shutdown()
        if self.backend != "nccl":
            # Its operations may still wait on a peer (until the collective timeout: a group
            # closed on an error or an interrupt), and a gloo group's destructor joins the
            # threads they run on: the last reference is dropped on a thread of its own.
            holder, pg = [pg], None
            threading.Thread(target=holder.clear, name="planaria-pg-release",
                             daemon=True).start()
        del pg


def _wait_for_peers(
    store: dist.Store, prefixed: dist.Store, gen: int, rank: int, world_size: int, timeout_s: float
) -> None:
    """Waits until every rank of the generation has arrived, or the generation is aborted.

    The process group's own rendezvous cannot be interrupted: a rank that waits
    in it for a peer that died waits for the whole join deadline. Meeting here
    first, in short waits that look at ``abort/<gen>`` in between, lets the
    controller end a doomed rendezvous at once.
    """
    from planaria.faults.errors import StepAborted

    if world_size == 1:
        return
    prefixed.set(f"present/{rank}", "1")
    keys = [f"present/{r}" for r in range(world_size)]
    start = time.monotonic()
    end = start + timeout_s
    fast = max(0.001, world_size / 16 * 0.001)
    pause = fast
    # Polled with check (a store wait that times out logs a warning in C++ every time).
    while not prefixed.check(keys):
        if store.check([store_keys.abort(gen)]):
            raise StepAborted(f"generation {gen} was aborted during its rendezvous")
        now = time.monotonic()
        if now > end:
            raise RuntimeError(
                f"timeout: generation {gen}'s peers did not all arrive within "
                f"{timeout_s:g} s (rank {rank} of {world_size})"
            )
        time.sleep(pause)
        if now - start >= PRESENCE_FAST_S:
            pause = min(PRESENCE_POLL_S, max(pause, 0.005) * 2)


def _sync_cuda() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def _chunks(flat: torch.Tensor) -> list[torch.Tensor]:
    flat = flat.view(-1)
    step = max(1, CHUNK_BYTES // max(1, flat.element_size()))
    return [flat[i : i + step] for i in range(0, flat.numel(), step)] or [flat]
