"""Sharded replicas: FSDP2 inside a replica, planaria's elastic groups across replicas.

With ``RunConfig(workers_per_replica=k)`` (k > 1) a replica is k worker processes.
Inside it they shard the parameters, gradients and optimizer state with FSDP2
(``fully_shard``) over torch's default process group, which each of them builds
once for its lifetime on the controller's store under the replica's own prefix:
the replica lives and dies as one, so its inner group never needs to be rebuilt.
Across replicas, worker i of every replica meets worker i of the others in the
generation's group for shard index i (planaria's own, rebuilt at every
generation: :class:`planaria.worker.collective.Collective`), which carries everything
that a one-worker replica's group carries: the gradient's all-reduce (here of
the shard), the step's status, and the state a joining replica receives.

A step (:class:`planaria.worker.reduce_sharded.ShardedReducer`): each
micro-batch's backward reduce-scatters the gradient inside the replica (FSDP2,
summing: planaria divides by the global batch itself), then each worker
all-reduces its shard of the summed gradient, with the step's status beside it,
over its shard index's group, and a last small all-reduce inside the replica
sums the status and the squared norms of the shards: every worker of every
replica then knows the step's totals and the global gradient norm, as with one
worker a replica.

The controller sees a replica as one worker, its leader (shard index 0), which
starts the others as Ray actors it owns (they die with it) and forwards each call
to them (:mod:`planaria.worker.replica`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planaria.wire import store_keys

__all__ = [
    "default_shard",
    "init_replica_group",
    "local",
    "shard_model",
]


def init_replica_group(
    store: dist.Store, replica_key: str, index: int, k: int, backend: str, timeout_s: float
) -> None:
    """This process's replica group: torch's default group, ranks = shard indices."""
    if dist.is_initialized():
        return  # one replica per process lifetime
    prefixed = dist.PrefixStore(store_keys.replica_prefix(replica_key), store)
    dist.init_process_group(backend, store=prefixed, rank=index, world_size=k,
                            timeout=timedelta(seconds=timeout_s))


def default_shard(model: nn.Module, mesh: Any) -> nn.Module:
    """Per-layer ``fully_shard`` as torchtitan does: the layers of the model's outermost
    ``nn.ModuleList`` and ``nn.Sequential`` containers (transformer blocks) are each a unit,
    the root takes what is left. (A module whose parameters another one reads directly,
    as ``nn.MultiheadAttention`` reads its ``out_proj``, must sit inside one unit: a spec
    whose model needs other units passes its own ``shard``.)"""
    from torch.distributed.fsdp import fully_shard

    for unit in _layers(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _layers(module: nn.Module) -> list[nn.Module]:
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        return [m for m in module if any(True for _ in m.parameters())]
    return [unit for child in module.children() for unit in _layers(child)]


def shard_model(
    model: nn.Module, k: int, device: torch.device,
    shard: Callable[[nn.Module, Any], nn.Module] | None = None,
) -> nn.Module:
    """Shards ``model`` over the replica's k workers (``shard`` or :func:`default_shard`)."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(device.type, list(range(k)))
    model = (shard or default_shard)(model, mesh)
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise TypeError(
            "the spec's shard function must return the model with fully_shard applied to "
            "its root (an FSDPModule)"
        )
    # FSDP2 would average inside the replica; planaria sums and divides by the global batch.
    # The factor is each unit's own (set on the root, it leaves the layers' averaging).
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain sum (gloo has no pre-multiplied sum; the factor is 1 anyway).
            module.set_force_sum_reduction_for_comms(True)
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this worker (a view of its storage); other tensors as they are."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor
