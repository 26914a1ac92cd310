"""A live replica's state sent to a joiner over the generation's group (a hot join).

The source describes its state (:meth:`StateTransfer.meta`: the tensors' layout,
the JSON metadata, the steps done), then sends every tensor; the joiner receives
them straight into its own live tensors (the model's, and the optimizer state it
pre-built at setup): no copy, and no page faults on the critical path. Big
tensors travel as they are, small ones coalesced in one buffer per dtype
(:func:`transfer_plan`), which sender and receiver compute alike from the same
layout.

Beside the first step (:class:`StateMeta` ``beside``, gloo and an unsharded replica with
no loss scaler or extra state): the source sends from a thread and goes on into the
next step at once, its update held at :attr:`ReplicaState.send_fence` until the last
byte left (a step's forward and backward only read the state; its module buffers, which
a forward changes, are copied first). The joiner receives the model's tensors before
it returns, the optimizer's on a thread (:class:`TransferThread`) while it computes its
share of the step, and waits for them before its reduction
(:meth:`ReplicaState.await_incoming`). The survivors' stall is then the model's bytes,
not the whole state's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from planaria.faults.errors import PlanariaError
from planaria.faults.points import FaultPoints
from planaria.wire.state_reports import StateMeta
from planaria.worker.commit import Commits
from planaria.worker.membership import Membership
from planaria.worker.replica_state import ReplicaState
from planaria.worker.sharded import local
from planaria.worker.state import load_hooked_model_tensors, load_state, tensor_layout
from planaria.worker.transfer_route import ReceiveRoute, SendRoute, end_reads
from planaria.worker.vitals import Vitals

__all__ = ["SMALL_TENSOR_BYTES", "StateTransfer", "TransferThread", "nbytes", "transfer_plan",
           "wire_parts"]

SMALL_TENSOR_BYTES = 1 << 20  # tensors below this travel coalesced in one buffer per dtype


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def transfer_plan(tensors: dict[str, torch.Tensor]) -> tuple[list[str], list[list[str]]]:
    """Big tensors travel as they are, small ones coalesced in one buffer per dtype.

    Sender and receiver compute this from the same layout and get the same order.
    """
    names = sorted(tensors)
    big = [k for k in names if nbytes(tensors[k]) >= SMALL_TENSOR_BYTES]
    small: dict[str, list[str]] = {}
    for k in names:
        if nbytes(tensors[k]) < SMALL_TENSOR_BYTES:
            small.setdefault(str(tensors[k].dtype), []).append(k)
    return big, [small[d] for d in sorted(small)]


def wire_parts(tensors: dict[str, torch.Tensor]
               ) -> list[tuple[list[str], list[list[str]]]]:
    """The transfer plans of the model's tensors and of the rest (the optimizer's), in the
    order they travel: a joiner can compute with the model before the rest arrives."""
    model = {k: v for k, v in tensors.items() if k.startswith("model/")}
    rest = {k: v for k, v in tensors.items() if not k.startswith("model/")}
    return [transfer_plan(model), transfer_plan(rest)]


class TransferThread:
    """A state transfer's part that runs beside the steps: its bytes, or its error."""

    def __init__(self, what: str, work: Callable[[], int],
                 on_end: Callable[[], None] | None = None) -> None:
        self.what = what
        self.began = time.perf_counter()
        self.seconds = 0.0  # how long it ran, once it ended
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._nbytes = 0
        self._thread = threading.Thread(target=self._run, args=(work, on_end),
                                        name=f"planaria-{what.replace(' ', '-')}", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], int], on_end: Callable[[], None] | None) -> None:
        try:
            self._nbytes = work()
        except BaseException as err:  # handed to whoever waits (the step, the controller)
            self._error = err
        finally:
            if on_end is not None:
                on_end()
            self.seconds = time.perf_counter() - self.began
            self._done.set()

    def wait(self, timeout_s: float | None = None) -> int:
        """The bytes moved, once it ended; raises its error, or TimeoutError past
        ``timeout_s``."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"the {self.what} did not end within {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._nbytes

    def end_quietly(self, timeout_s: float | None = None) -> None:
        """Waits for it to end (bounded), its outcome left aside (a new transfer replaces it)."""
        self._done.wait(timeout_s)


class StateTransfer:
    """Sends this replica's state to joiners, or receives a source's into it."""

    def __init__(self, name: str, state: ReplicaState, commits: Commits,
                 membership: Membership, vitals: Vitals, faults: FaultPoints) -> None:
        """``faults``: the worker's (``worker.state_sending``, ``worker.state_receiving``)."""
        self.name = name
        self.state = state
        self.commits = commits
        self.membership = membership
        self.vitals = vitals
        self.faults = faults
        self.sending: TransferThread | None = None  # a send beside the steps
        self.received: TransferThread | None = None  # the last receive beside the steps
        self.route: ReceiveRoute | None = None  # how the last receive's parts came

    def can_go_beside(self) -> bool:
        """The state can be sent beside the next step (see the module's docstring): on gloo
        with every tensor on the group's device (NCCL orders a communicator's operations:
        a send on another thread could deadlock with the step's all-reduce), an unsharded
        replica, no loss scaler and no extra state (their setters could change what the
        joiner's first forward computes)."""
        comm, state = self.membership.comm, self.state
        return (comm is not None and comm.backend == "gloo" and state.shape.k == 1
                and state.scaler is None and state.spec.extra_state is None
                and state.device.type == comm.device.type)

    def meta(self, *, beside: bool = False) -> StateMeta:
        """What a joiner needs besides tensors: the layout, the JSON metadata, steps done;
        ``beside``: sent beside the next step if it can be (:meth:`can_go_beside`)."""
        tensors, meta = self.state.flatten()
        return StateMeta(layout=tensor_layout(tensors), meta=self.state.with_extra_state(meta),
                         steps_done=self.commits.steps_done,
                         on_host=sorted(k for k, v in tensors.items() if v.device.type == "cpu"),
                         beside=beside and self.can_go_beside())

    def send(self, dsts: list[int], *, beside: bool = False) -> int:
        """Sends the whole state to ranks ``dsts`` over the generation's group; returns bytes.

        ``beside``: from a thread, returning at once (the next update waits at the state's
        send fence until the last byte left)."""
        self.state.refuse_if_dirty(self.name, "send its state")
        comm = self.membership.comm
        assert comm is not None
        if self.sending is not None:  # a send of an earlier generation: ended with its group
            self.sending.end_quietly()
            self.sending = None
        steps_done = self.commits.steps_done
        tensors, _ = self.state.flatten()
        if beside:  # a forward changes the buffers in place: they are copied now
            held = {f"model/{n}" for n, _ in self.state.model.named_buffers()}
            tensors = {k: v.clone() if k in held else v for k, v in tensors.items()}
        # Small tensors coalesced on the group's device (Adam's step counters live on the
        # host beside CUDA parameters): copies, taken now; big ones go as they are, staged
        # if need be.
        wire = comm.device
        parts = [[tensors[k].contiguous() for k in big]
                 + [torch.cat([tensors[k].reshape(-1).to(wire) for k in names])
                    for names in small]
                 for big, small in wire_parts(tensors)]
        total = sum(nbytes(b) for part in parts for b in part) * len(dsts)

        def send_all() -> int:  # every joiner's model part first: they all compute sooner
            routes = [SendRoute(comm, dst) for dst in dsts]
            tags = [route.open(0) for route in routes]
            try:
                for i, route in enumerate(routes):
                    tags[i] = route.send(parts[0], tags[i], self.vitals.bytes_moved)
                if beside and self.faults.armed:
                    self.faults.hit("worker.state_sending", step=steps_done)
                for i, route in enumerate(routes):
                    route.send(parts[1], tags[i], self.vitals.bytes_moved)
            finally:
                if any(route.reader for route in routes):
                    end_reads()
            return total

        if not beside:
            self.vitals.set_phase("send_state", steps_done)
            send_all()
            self.vitals.set_phase("idle", steps_done)
            return total
        fence = self.state.send_fence
        fence.close()
        fence.go()

        def send_beside() -> int:
            fence.wait_go(0.0)
            return send_all()

        self.sending = TransferThread("state send", send_beside, on_end=fence.open)
        return total

    def receive(self, src: int, source: StateMeta) -> int:
        """Receives the state sent by rank ``src`` (described by ``source``, the source's
        :meth:`meta`) into this replica's live tensors; returns bytes (``source.beside``:
        the model's, received before it returns; the rest arrives on a thread, see
        :meth:`wait_received`)."""
        comm = self.membership.comm
        assert comm is not None
        state = self.state
        self.vitals.set_phase("recv_state", -1)
        # Received into the live tensors: a save's copy, an earlier receipt's thread (ended
        # with its group) end first.
        state.wait_readers()
        live, _ = state.flatten()
        on_host = set(source.on_host)
        tensors: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in source.layout.items():
            target = live.get(name)
            want = getattr(torch, dtype)
            fits = (target is not None and list(target.shape) == list(shape)
                    and target.dtype == want)
            if not fits and name.startswith("model/"):
                raise PlanariaError(f"{name}: the joiner's model does not match the source's")
            if target is None or not fits or not target.is_contiguous():
                # Where the source keeps it (Adam's step counters on the host).
                where = torch.device("cpu") if name in on_host else state.device
                target = torch.empty(shape, dtype=want, device=where)
            tensors[name] = target
        model_part, rest_part = wire_parts(tensors)
        route = self.route = ReceiveRoute(comm, src, may_read=source.by_memory)
        model_bytes, tag = self._receive_part(route, tensors, model_part, route.open(0))
        with torch.no_grad():
            model_live = {f"model/{k}": local(v) for k, v in state.model.state_dict().items()}
            for name, tensor in tensors.items():
                if name in model_live and model_live[name].data_ptr() != tensor.data_ptr():
                    model_live[name].copy_(tensor)
            load_hooked_model_tensors(state.model, tensors)

        def receive_rest() -> int:
            if source.beside and self.faults.armed:
                self.faults.hit("worker.state_receiving", step=source.steps_done)
            rest_bytes, _ = self._receive_part(route, tensors, rest_part, tag)
            optim = {k: v for k, v in tensors.items() if k.startswith("optim/")}
            load_state(None, state.optimizer, state.scheduler, optim, source.meta)
            state.set_extra_state(source.meta)
            return rest_bytes

        if source.beside:
            self.commits.drop_pending()
            self.commits.steps_done = source.steps_done
            self.received = state.incoming = TransferThread("state receipt", receive_rest)
            self.vitals.set_phase("idle", self.commits.steps_done)
            return model_bytes
        rest_bytes = receive_rest()
        self.commits.drop_pending()
        self.commits.steps_done = source.steps_done
        self.vitals.set_phase("idle", self.commits.steps_done)
        return model_bytes + rest_bytes

    def wait_received(self, timeout_s: float) -> tuple[float, list[str]]:
        """The seconds the last receive's part beside the steps took, once it all arrived
        and is loaded, and how each part came (``"memory"``, ``"group"``:
        :mod:`planaria.worker.transfer_route`); raises its error (or TimeoutError past
        ``timeout_s``)."""
        if self.received is None or self.route is None:
            raise PlanariaError(f"{self.name} has no state arriving beside its steps")
        self.received.wait(timeout_s)
        return self.received.seconds, list(self.route.routes)

    def _receive_part(self, route: ReceiveRoute, tensors: dict[str, torch.Tensor],
                      part: tuple[list[str], list[list[str]]], tag: int) -> tuple[int, int]:
        """Receives one of :func:`wire_parts`' parts from chunk tag ``tag`` on; returns its
        bytes and the next tag."""
        comm = self.membership.comm
        assert comm is not None
        big, small = part
        flats = [torch.empty(sum(tensors[k].numel() for k in names),
                             dtype=tensors[names[0]].dtype, device=comm.device)
                 for names in small]
        with torch.no_grad():
            tag = route.receive([tensors[k] for k in big] + flats, tag,
                                self.vitals.bytes_moved)
            for names, flat in zip(small, flats, strict=True):
                offset = 0
                for k in names:
                    n = tensors[k].numel()
                    tensors[k].copy_(flat[offset : offset + n].view_as(tensors[k]))
                    offset += n
        return sum(nbytes(tensors[k]) for k in big) + sum(nbytes(f) for f in flats), tag
