"""How a state transfer's bytes go from its source to one joiner: over the group, or read by
the joiner straight out of the source's memory when both run on one node
(:mod:`planaria.worker.peer_memory`: one kernel copy made by the joiner, where the group's
loopback socket costs two and the system calls between, on the node's cores that the
step's compute needs).

The two ends agree per transfer, over the group (a few int64s each way, on gloo only: NCCL
moves device tensors, which no process can read from another's memory):

1. the joiner says where it runs and whether it may read (``hello``: node, pid namespace,
   pid, ``RunConfig.state_by_memory``);
2. for each part of the state (the model's, then the rest), the source sends a header: 1
   and its pid and each buffer's address and size when the joiner is on its node and may
   read, else 0;
3. on a 1, the joiner reads the buffers, telling the source every :data:`ANSWER_BYTES` read
   (2: more to come, and how many bytes it read: the source's progress moves as its bytes
   go, as a sender's does), then answers 0 (read) or 1 (the kernel refused: send them);
   on a 0 in the header or a refusal the buffers go over the group as before.

The source holds its buffers unchanged until the answer (its update waits at the state's
send fence until the transfer's end): a joiner reads a consistent state. A source that dies
during the read makes the read fail (:class:`peer_memory.PeerGone`) and the receipt with it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from planaria.worker import peer_memory

__all__ = ["ANSWER_BYTES", "ReceiveRoute", "SendRoute", "end_reads"]

_log = logging.getLogger(__name__)

_READ, _SEND, _MORE = 0, 1, 2  # a joiner's answers to a header: [what, bytes read]
ANSWER_BYTES = 256 << 20
"""A joiner reading a source's memory tells it every this many bytes (~0.05-0.1 s of reading;
a transfer whose bytes move is busy, not hung: planaria.control.liveness)."""


def _readable(tensors: Sequence[torch.Tensor]) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


class SendRoute:
    """The source's end, for one joiner (rank ``dst``)."""

    def __init__(self, comm: Any, dst: int) -> None:
        self.comm, self.dst = comm, dst
        self.talks = comm.backend == "gloo"  # the ends agree on a route (else: the group)
        self.by_memory = False
        self.reader = 0  # the joiner's pid, where it reads

    def open(self, tag: int) -> int:
        """Hears the joiner's hello (from chunk tag ``tag``); returns the next tag."""
        if not self.talks:
            return tag
        hello = torch.zeros(4, dtype=torch.int64)
        tag = self.comm.recv([hello], self.dst, first_tag=tag)
        node, pid_ns, pid, may_read = (int(v) for v in hello)
        here = peer_memory.identity()
        self.by_memory = bool(may_read) and peer_memory.available() and (
            node, pid_ns) == here[:2] and node != 0
        if self.by_memory:
            self.reader = pid
        return tag

    def send(self, buffers: Sequence[torch.Tensor], tag: int,
             on_progress: Callable[[int], None] | None) -> int:
        """One part's ``buffers``, read by the joiner or sent; returns the next tag."""
        if self.talks:
            by_memory = self.by_memory and _readable(buffers)
            header = torch.zeros(2 + 2 * len(buffers), dtype=torch.int64)
            if by_memory:
                # Yama allows one named reader at a time: this joiner, for this part.
                peer_memory.allow_reader(self.reader)
                header[0], header[1] = 1, os.getpid()
                for i, b in enumerate(buffers):
                    header[2 + 2 * i] = b.data_ptr()
                    header[3 + 2 * i] = b.numel() * b.element_size()
            tag = self.comm.send([header], self.dst, first_tag=tag)
            said = 0  # bytes the joiner said it read, counted in the progress already
            while by_memory:
                answer = torch.zeros(2, dtype=torch.int64)
                tag = self.comm.recv([answer], self.dst, first_tag=tag)
                what, nbytes = int(answer[0]), int(answer[1])
                said += nbytes
                if on_progress is not None and nbytes:
                    on_progress(nbytes)
                if what == _READ:
                    return tag
                if what == _SEND:
                    self.by_memory = by_memory = False  # refused: the rest over the group too
            if said and on_progress is not None:
                on_progress = _after(said, on_progress)
        return int(self.comm.send(list(buffers), self.dst, on_progress=on_progress,
                                  first_tag=tag))


def end_reads() -> None:
    """After a send's last part: no joiner may read this process's memory any more."""
    peer_memory.allow_reader(0)


def _after(counted: int, on_progress: Callable[[int], None]) -> Callable[[int], None]:
    """``on_progress`` for a part sent again after a refused read: the first ``counted``
    bytes were counted as the joiner read them."""
    left = counted

    def progress(nbytes: int) -> None:
        nonlocal left
        skip = min(left, nbytes)
        left -= skip
        if nbytes > skip:
            on_progress(nbytes - skip)

    return progress


class ReceiveRoute:
    """The joiner's end, from the source (rank ``src``). ``routes``: how each part came
    (``"memory"`` or ``"group"``), in order."""

    def __init__(self, comm: Any, src: int, *, may_read: bool) -> None:
        self.comm, self.src = comm, src
        self.talks = comm.backend == "gloo"
        self.may_read = may_read and peer_memory.available()
        self.routes: list[str] = []

    def open(self, tag: int) -> int:
        """Says hello (from chunk tag ``tag``); returns the next tag."""
        if not self.talks:
            return tag
        node, pid_ns, pid = peer_memory.identity()
        hello = torch.tensor([node, pid_ns, pid, int(self.may_read)], dtype=torch.int64)
        return int(self.comm.send([hello], self.src, first_tag=tag))

    def receive(self, targets: Sequence[torch.Tensor], tag: int,
                on_progress: Callable[[int], None] | None) -> int:
        """One part into ``targets`` (the source's buffers' layout); returns the next tag.
        Raises :class:`peer_memory.PeerGone` if the source died during a read."""
        if self.talks:
            header = torch.zeros(2 + 2 * len(targets), dtype=torch.int64)
            tag = self.comm.recv([header], self.src, first_tag=tag)
            if int(header[0]) == 1:
                answer, tag, counted = self._read(header, targets, tag, on_progress)
                if answer == _READ:
                    self.routes.append("memory")
                    return tag
                if counted and on_progress is not None:
                    on_progress = _after(counted, on_progress)
        self.routes.append("group")
        return int(self.comm.recv(list(targets), self.src, on_progress=on_progress,
                                  first_tag=tag))

    def _read(self, header: torch.Tensor, targets: Sequence[torch.Tensor], tag: int,
              on_progress: Callable[[int], None] | None) -> tuple[int, int, int]:
        """Reads the buffers ``header`` describes into ``targets``, telling the source as it
        goes; returns the last answer sent (read, or refused), the next tag and the bytes
        counted in ``on_progress``."""
        unsaid = counted = 0

        def read(nbytes: int) -> None:
            nonlocal unsaid, counted, tag
            if on_progress is not None:
                on_progress(nbytes)
            unsaid += nbytes
            counted += nbytes
            if unsaid >= ANSWER_BYTES:
                tag, unsaid = self._answer(_MORE, unsaid, tag), 0

        answer = _SEND
        if _readable(targets):
            pid = int(header[1])
            pairs = [(t, int(header[2 + 2 * i]), int(header[3 + 2 * i]))
                     for i, t in enumerate(targets)]
            try:
                peer_memory.read_into(pid, pairs, read)
                answer = _READ
            except peer_memory.Refused as err:
                _log.warning("reading the state out of process %d's memory was refused "
                             "(%s): it comes over the group", pid, err)
        return answer, self._answer(answer, unsaid if answer == _READ else 0, tag), counted

    def _answer(self, what: int, nbytes: int, tag: int) -> int:
        return int(self.comm.send([torch.tensor([what, nbytes], dtype=torch.int64)], self.src,
                                  first_tag=tag))
