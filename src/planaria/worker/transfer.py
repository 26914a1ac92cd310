"""A live replica's state sent to a joiner over the generation's group (a hot join).

The source describes its state (:meth:`StateTransfer.meta`: the tensors' layout,
the JSON metadata, the steps done), then sends every tensor; the joiner receives
them straight into its own live tensors (the model's, and the optimizer state it
pre-built at setup): no copy, and no page faults on the critical path. Big
tensors travel as they are, small ones coalesced in one buffer per dtype
(:func:`transfer_plan`), which sender and receiver compute alike from the same
layout.
"""

from __future__ import annotations

import torch

from planaria.faults.errors import PlanariaError
from planaria.wire.state_reports import StateMeta
from planaria.worker.commit import Commits
from planaria.worker.membership import Membership
from planaria.worker.replica_state import ReplicaState
from planaria.worker.sharded import local
from planaria.worker.state import load_hooked_model_tensors, load_state, tensor_layout
from planaria.worker.vitals import Vitals

__all__ = ["SMALL_TENSOR_BYTES", "StateTransfer", "nbytes", "transfer_plan"]

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


class StateTransfer:
    """Sends this replica's state to joiners, or receives a source's into it."""

    def __init__(self, name: str, state: ReplicaState, commits: Commits,
                 membership: Membership, vitals: Vitals) -> None:
        self.name = name
        self.state = state
        self.commits = commits
        self.membership = membership
        self.vitals = vitals

    def meta(self) -> StateMeta:
        """What a joiner needs besides tensors: the layout, the JSON metadata, steps done."""
        tensors, meta = self.state.flatten()
        return StateMeta(layout=tensor_layout(tensors), meta=self.state.with_extra_state(meta),
                         steps_done=self.commits.steps_done,
                         on_host=sorted(k for k, v in tensors.items() if v.device.type == "cpu"))

    def send(self, dsts: list[int]) -> int:
        """Sends the whole state to ranks ``dsts`` over the generation's group; returns bytes."""
        self.state.refuse_if_dirty(self.name, "send its state")
        comm = self.membership.comm
        assert comm is not None
        steps_done = self.commits.steps_done
        self.vitals.set_phase("send_state", steps_done)
        tensors, _ = self.state.flatten()
        big, small = transfer_plan(tensors)
        buffers = [tensors[k].contiguous() for k in big]
        # Small tensors coalesced on the group's device (Adam's step counters live on the
        # host beside CUDA parameters); big ones go as they are, staged if need be.
        wire = comm.device
        buffers += [torch.cat([tensors[k].reshape(-1).to(wire) for k in names])
                    for names in small]
        for dst in dsts:
            comm.send(buffers, dst, on_progress=self.vitals.bytes_moved)
        self.vitals.set_phase("idle", steps_done)
        return sum(nbytes(b) for b in buffers) * len(dsts)

    def receive(self, src: int, source: StateMeta) -> int:
        """Receives the state sent by rank ``src`` (described by ``source``, the source's
        :meth:`meta`) into this replica's live tensors; returns bytes."""
        comm = self.membership.comm
        assert comm is not None
        state = self.state
        self.vitals.set_phase("recv_state", -1)
        state.copy_fence.wait()  # received into the live tensors: a save's copy ends first
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
        big, small = transfer_plan(tensors)
        flats = [
            torch.empty(
                sum(tensors[k].numel() for k in names),
                dtype=tensors[names[0]].dtype,
                device=comm.device,
            )
            for names in small
        ]
        with torch.no_grad():
            comm.recv([tensors[k] for k in big] + flats, src,
                      on_progress=self.vitals.bytes_moved)
            for names, flat in zip(small, flats, strict=True):
                offset = 0
                for k in names:
                    n = tensors[k].numel()
                    tensors[k].copy_(flat[offset : offset + n].view_as(tensors[k]))
                    offset += n
            model_live = {f"model/{k}": local(v) for k, v in state.model.state_dict().items()}
            for name, tensor in tensors.items():
                if name in model_live and model_live[name].data_ptr() != tensor.data_ptr():
                    model_live[name].copy_(tensor)
            load_hooked_model_tensors(state.model, tensors)
        optim = {k: v for k, v in tensors.items() if k.startswith("optim/")}
        load_state(None, state.optimizer, state.scheduler, optim, source.meta)
        state.set_extra_state(source.meta)
        self.commits.drop_pending()
        self.commits.steps_done = source.steps_done
        self.vitals.set_phase("idle", self.commits.steps_done)
        return sum(nbytes(tensors[k]) for k in big) + sum(nbytes(f) for f in flats)
