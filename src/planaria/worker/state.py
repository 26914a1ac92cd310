"""A replica's training state as named tensors plus JSON metadata.

One representation serves both hot-join (sent over the process group) and
checkpoints (safetensors + JSON): ``tensors`` maps names like
``model/fc.weight`` or ``optim/3/exp_avg`` to tensors, and ``meta`` holds
everything else (optimizer hyper-parameters and non-tensor state, the LR
scheduler's state, the step), all JSON-serialisable. No pickle.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch

from planaria.checkpoint.checksum import byte_view, crc32c
from planaria.worker.sharded import local as _local

__all__ = ["TrainState", "flatten_state", "jsonable", "load_hooked_model_tensors",
           "load_state", "model_checksum",
           "shard_origins", "tensor_layout"]

TrainState = tuple[dict[str, torch.Tensor], dict[str, Any]]


def jsonable(value: Any, where: str) -> Any:
    """``value`` (a tuple as a list) if JSON can hold it; else a TypeError naming ``where``."""
    if isinstance(value, tuple):
        value = list(value)
    try:
        json.dumps(value)
    except TypeError as err:
        raise TypeError(
            f"{where} is not JSON-serialisable ({err}); planaria never pickles state"
        ) from err
    return value


def flatten_state(
    model: torch.nn.Module, optimizer: Any, scheduler: Any | None, *, whole: bool = False
) -> TrainState:
    """Names every tensor of the model and optimizer state; the rest goes to ``meta``.

    The tensors are the live ones (no copy): callers copy or send them. A sharded
    replica's are this worker's shards, or with ``whole`` the whole tensors gathered
    from every worker of the replica (each must call it: it is a collective).
    """
    local = _whole if whole else _local
    opt_state = optimizer.state_dict()
    # A sharded replica's tensors are DTensors: each worker names and moves its own shards.
    tensors = {name: local(t.detach()) for name, t in _state_tensors(model, opt_state)}
    opt_scalars: dict[str, dict[str, Any]] = {}
    for pid, pstate in opt_state["state"].items():
        for key, value in pstate.items():
            if not isinstance(value, torch.Tensor):
                opt_scalars.setdefault(str(pid), {})[key] = jsonable(
                    value, f"optimizer state {key}"
                )
    meta: dict[str, Any] = {
        "optim_param_groups": jsonable(opt_state["param_groups"], "optimizer param_groups"),
        "optim_scalars": opt_scalars,
        "scheduler": None
        if scheduler is None
        else jsonable(scheduler.state_dict(), "lr scheduler state"),
    }
    return tensors, meta


def shard_origins(model: torch.nn.Module, optimizer: Any) -> dict[str, tuple[tuple[int, ...], int]]:
    """For each tensor of :func:`flatten_state` that is this worker's shard of a sharded
    replica's tensor: ``(whole shape, the shard's first row)`` (FSDP2 shards along dim 0)."""
    return {name: origin for name, t in _state_tensors(model, optimizer.state_dict())
            if (origin := _shard_origin(t)) is not None}


def _state_tensors(
    model: torch.nn.Module, opt_state: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the model's and the optimizer's state, under its name in a
    checkpoint or a state transfer (``model/<name>``, ``optim/<param index>/<key>``)."""
    for name, tensor in model.state_dict(keep_vars=False).items():
        yield f"model/{name}", tensor
    for pid, pstate in opt_state["state"].items():
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor):
                yield f"optim/{pid}/{key}", value


def _shard_origin(tensor: torch.Tensor) -> tuple[tuple[int, ...], int] | None:
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None:
        return None
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tensor.placements  # type: ignore[attr-defined]
    if any(not (isinstance(p, Shard) and p.dim == 0) for p in placements):
        raise ValueError(f"a sharded tensor placed {placements}: planaria stores shards of "
                         "dim 0 only (FSDP2's fully_shard without shard_placement_fn)")
    _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    return tuple(int(d) for d in tensor.shape), int(offset[0])


def tensor_layout(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[list[int], str]]:
    """name → (shape, dtype name): enough for a receiver to allocate buffers."""
    return {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in tensors.items()}


def load_state(
    model: torch.nn.Module | None,
    optimizer: Any,
    scheduler: Any | None,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
) -> None:
    """Loads state produced by :func:`flatten_state` (on any replica) into live objects.

    ``model=None`` skips the model (its tensors were already filled in place).
    """
    if model is not None:
        model_sd = {
            k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")
        }
        missing, unexpected = model.load_state_dict(model_sd, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"state does not fit the model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("optim/"):
            _, pid, key = name.split("/", 2)
            state.setdefault(int(pid), {})[key] = value
    for pid, scalars in meta.get("optim_scalars", {}).items():
        state.setdefault(int(pid), {}).update(scalars)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, pstate in state.items():
        if index < len(params):
            for key, value in pstate.items():
                pstate[key] = _like_param(value, params[index])
    optimizer.load_state_dict({"state": state, "param_groups": meta["optim_param_groups"]})
    if scheduler is not None and meta.get("scheduler") is not None:
        # Only the keys this scheduler has: a saved state must not add attributes to it.
        own = scheduler.state_dict()
        scheduler.load_state_dict({k: v for k, v in meta["scheduler"].items() if k in own})


def _like_param(value: Any, param: torch.Tensor) -> Any:
    """A sharded parameter's optimizer state back as a DTensor of its layout (the state was
    moved as this worker's shards); anything else as it is."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None or not isinstance(value, torch.Tensor) or hasattr(value, "device_mesh"):
        return value
    if value.shape != _local(param).shape:
        return value  # a scalar such as Adam's step: not sharded
    from torch.distributed.tensor import DTensor

    placements = param.placements  # type: ignore[attr-defined]
    return DTensor.from_local(value, mesh, placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def load_hooked_model_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Loads the ``model/`` tensors whose state-dict entries are not the model's own storage
    through ``load_state_dict``: a state_dict hook's copies (torchtitan's fused QKV linear
    saves its ``wqkv`` as ``wq``/``wk``/``wv`` copies, and its load hook merges them back),
    which a fill in place would leave the model without. A no-op for other models."""
    own = {t.data_ptr() for t in (*model.parameters(), *model.buffers())
           if not hasattr(t, "device_mesh")}
    copies = {name: t for name, t in model.state_dict().items()
              if not hasattr(t, "device_mesh") and t.data_ptr() not in own}
    if copies:
        model.load_state_dict({name: tensors[f"model/{name}"] for name in copies
                               if f"model/{name}" in tensors}, strict=False)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def model_checksum(model: torch.nn.Module) -> int:
    """CRC-32C (in hardware) over the bytes of every parameter and buffer, in name order (of
    this worker's shards, in a sharded replica): equal on every replica, or they drifted
    (or a restore went wrong)."""
    crc = 0
    for _, tensor in sorted(model.state_dict().items()):
        crc = crc32c(byte_view(_local(tensor.detach()).cpu().contiguous()), crc)
    return crc
