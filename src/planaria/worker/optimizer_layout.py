"""An optimizer's state made without a step over the model: a joiner's landing memory.

A replacement or a spare receives (or restores) the optimizer state into tensors it made
before, so that the bytes land in memory already allocated and touched (a receipt into
fresh memory beside a step's compute ran 3-4x slower, measured at the ``realistic``
bench size: its page faults contend with the compute's allocations). One optimizer step
on zero gradients makes them, but over an 85M-parameter model that step takes ~2 s of
CPU (Adam, 2 cores), beside the survivors' steps.

:func:`prebuild_by_probe` makes them for a fraction of that: it steps a throwaway
optimizer of the same class and hyper-parameters (each param group's) over a tiny
parameter of each dtype and device, and gives every parameter the state it showed: a
zeroed tensor of the parameter's shape (and the probe's dtype) where the probe's state
had the tiny parameter's shape, a copy of the probe's value otherwise (Adam's ``step``).
What a probe cannot tell (an optimizer whose class cannot be built again from its
``defaults``, or whose state is not per parameter) is left to the caller's step. The
values are garbage to be overwritten: a received or restored state replaces them all.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from planaria.worker.memory_reserve import Region, region_bytes

__all__ = ["StatePlace", "claim_region_for_state", "move_state_into", "prebuild_by_probe"]

_log = logging.getLogger(__name__)

_PROBE_NUMEL = 3  # a shape no scalar state has: what has it is per element of the parameter


def _probe(optimizer: Any, group: dict[str, Any], like: torch.Tensor) -> dict[str, Any] | None:
    """The state a fresh optimizer of ``optimizer``'s class, with ``group``'s settings,
    keeps for a parameter of ``like``'s dtype and device after one step (None: none)."""
    tiny = torch.zeros(_PROBE_NUMEL, dtype=like.dtype, device=like.device, requires_grad=True)
    settings = {k: v for k, v in {**optimizer.defaults, **group}.items() if k != "params"}
    accepts = inspect.signature(type(optimizer).__init__).parameters
    if not any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepts.values()):
        # what the class keeps in its defaults but does not take (AdamW's
        # decoupled_weight_decay, set by the class itself)
        settings = {k: v for k, v in settings.items() if k in accepts}
    probe = type(optimizer)([tiny], **settings)
    tiny.grad = torch.zeros_like(tiny)
    probe.step()
    state = probe.state.get(tiny)
    return dict(state) if state else None


_Layout = tuple[dict[Any, dict[str, Any]], list[tuple[Any, str, torch.dtype]]]


def _layout(optimizer: Any) -> _Layout | None:
    """Per parameter, the state a probe shows (module docstring), its per-element tensors
    left None and listed in order as (parameter, name, dtype); None where no probe tells."""
    made: dict[Any, dict[str, Any]] = {}
    per_element: list[tuple[Any, str, torch.dtype]] = []
    try:
        for group in optimizer.param_groups:
            probes: dict[tuple[torch.dtype, torch.device], dict[str, Any] | None] = {}
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if type(p) is not torch.nn.Parameter and type(p) is not torch.Tensor:
                    return None  # a DTensor's, a wrapper's: the caller's step knows it
                key = (p.dtype, p.device)
                if key not in probes:
                    probes[key] = _probe(optimizer, group, p)
                shown = probes[key]
                if shown is None:
                    return None
                made[p] = {}
                for name, v in shown.items():
                    if isinstance(v, torch.Tensor) and v.shape == (_PROBE_NUMEL,):
                        per_element.append((p, name, v.dtype))
                        made[p][name] = None  # made by the caller, in this place of the order
                    else:
                        made[p][name] = v.clone() if isinstance(v, torch.Tensor) else v
    except Exception:  # a class that cannot be built again from its defaults, a closure
        _log.debug("no probe of %s's state", type(optimizer).__name__, exc_info=True)
        return None
    return made, per_element


def _region_for_layout(per_element: list[tuple[Any, str, torch.dtype]],
                       region_for: Callable[[int], Region | None] | None) -> Region | None:
    if region_for is None or not per_element:
        return None
    if not all(p.device.type == "cpu" for p, _, _ in per_element):
        return None
    return region_for(region_bytes([(p.shape, dtype) for p, _, dtype in per_element]))


def prebuild_by_probe(optimizer: Any,
                      region_for: Callable[[int], Region | None] | None = None) -> bool:
    """Gives every parameter of ``optimizer`` that requires a gradient the state a probe
    shows (module docstring); True if it did, False if it could not (nothing changed).

    ``region_for`` (:func:`planaria.worker.memory_reserve.claim`): asked for the bytes of
    every per-element tensor (parameters on the host only); where it gives a region, the
    tensors are carved out of it, values and all garbage, instead of made as zeros."""
    if optimizer.state:
        return True  # it has a state already
    layout = _layout(optimizer)
    if layout is None:
        return False
    made, per_element = layout
    region = _region_for_layout(per_element, region_for)
    for p, name, dtype in per_element:
        made[p][name] = (region.take(p.shape, dtype) if region is not None
                         else torch.zeros_like(p, dtype=dtype))
    for p, state in made.items():
        optimizer.state[p] = state
    return True


@dataclass(frozen=True)
class StatePlace:
    """A region sized for an optimizer's per-element state, and that state's slots in the
    order it was sized for: (parameter, name, dtype)."""

    region: Region
    slots: list[tuple[Any, str, torch.dtype]]


def claim_region_for_state(optimizer: Any,
                           region_for: Callable[[int], Region | None]) -> StatePlace | None:
    """A region (``region_for``) the size of the per-element state a probe shows for
    ``optimizer`` (parameters on the host only), for :func:`move_state_into` once the
    state exists; None where no probe tells, or no region is given."""
    layout = _layout(optimizer)
    region = None if layout is None else _region_for_layout(layout[1], region_for)
    return None if region is None or layout is None else StatePlace(region, layout[1])


def move_state_into(optimizer: Any, place: StatePlace) -> int:
    """Moves ``optimizer``'s per-element state tensors into ``place``'s region, values and
    all, in the order it was sized for; returns the bytes moved. A tensor whose shape or
    dtype is not the probe's stays where it is. A worker that is not a joiner makes its
    optimizer state at its first step, in memory of its own: moved into a region, it is
    left to the next joiner on the node when the worker dies."""
    moved = 0
    for p, name, dtype in place.slots:
        old = optimizer.state.get(p, {}).get(name)
        if not isinstance(old, torch.Tensor) or old.shape != p.shape or old.dtype != dtype:
            continue
        try:
            new = place.region.take(p.shape, dtype)
        except ValueError:  # the region is full
            break
        new.copy_(old)
        optimizer.state[p][name] = new
        moved += new.numel() * new.element_size()
    return moved
