"""A sharded replica's gradient reduction (see :mod:`planaria.worker.sharded` for the layout).

Each micro-batch's backward reduce-scatters the gradient inside the replica (FSDP2),
then each worker all-reduces its shard of the summed gradient, with the step's
status beside it, over its shard index's group across the replicas, and a last
small all-reduce inside the replica sums the status and the squared norms of the
shards: every worker of every replica then knows the step's totals and the global
gradient norm, as with one worker a replica.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from planaria.faults.errors import StepAborted
from planaria.worker.collective import Collective
from planaria.worker.sharded import local

__all__ = ["ShardedReducer"]


class ShardedReducer:
    """A :class:`planaria.worker.reduce.Reducer` for a replica of k workers (FSDP2 inside)."""

    def __init__(self, params: list[nn.Parameter], device: torch.device) -> None:
        self.params = params
        self.device = device

    def gradients(self) -> list[torch.Tensor]:
        """This worker's shard of every parameter's gradient (made zero where none)."""
        out = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(local(p.grad))
        return out

    def zero(self) -> None:
        for p in self.params:
            p.grad = None

    def start_step(self) -> None:
        pass

    def before_last_backward(self, comm: Collective) -> None:
        pass

    def reduce(
        self, comm: Collective, status: torch.Tensor | None, extra: list[torch.Tensor],
        meanwhile: Callable[[], None],
    ) -> float:
        """Sums the shards' gradients over the replicas (and ``status`` over every worker of
        every replica, in place); returns the global norm of the reduced gradient. Nothing
        runs ``meanwhile``: the next step's share loads when that step starts.

        The replica's workers leave together: one whose group across replicas failed (a
        peer replica died) still takes part in the replica's own last all-reduce, with a
        flag that makes every worker of the replica raise, so that none is left waiting
        in a collective of the replica that the others never enter.
        """
        grads = self.gradients()
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
        failed: BaseException | None = None
        try:
            comm.allreduce_sum([flat, *([] if status is None else [status]), *extra])
        except Exception as err:
            failed = err
        n_status = 0 if status is None else len(status)
        # Inside the replica: a failure flag, the squared norms of the shards and the status
        # (each worker holds its shard index's sum over the replicas), summed.
        tail = torch.zeros(2 + n_status, dtype=torch.float64, device=self.device)
        tail[0] = 1.0 if failed is not None else 0.0
        if failed is None:
            tail[1] = flat.double().square().sum() if flat.numel() else 0.0
            if status is not None:
                tail[2:].copy_(status)
        dist.all_reduce(tail)
        if failed is not None:
            raise failed
        if tail[0] > 0:
            raise StepAborted("the reduction failed on another worker of this replica")
        for tensor in extra:  # the buffers' contributions: summed over every worker
            dist.all_reduce(tensor)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        if status is not None:
            status.copy_(tail[2:])
        norm2 = float(tail[1])
        return math.sqrt(norm2) if math.isfinite(norm2) else math.nan

    def agree_loaded(self, ok: bool) -> None:
        """After a step's load, before any of FSDP's collectives: whether every worker of the
        replica loaded its samples (one small all-reduce inside the replica). A worker whose
        load failed raises its own error (the leader reports it); the others raise
        StepAborted: nobody waits in a collective the failed one never enters, and the
        replica stays whole (a failing sample then runs on another replica, see
        planaria.control.attribution)."""
        flag = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(flag)
        if ok and flag.item() > 0:
            raise StepAborted("another worker of this replica could not load its samples")

    def status_room(self) -> int | None:
        return None  # the status is reduced beside the shards, as a tensor of its own

    def gradient_copy(self) -> None:
        return None  # a sharded replica keeps nothing of a failed step

    def close(self) -> None:
        pass
