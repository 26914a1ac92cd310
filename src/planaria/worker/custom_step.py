"""A user's micro-batch step (``TrainSpec.forward_backward``): its forwards and its calls
to ``backward``, planaria's backward doing the scaling.

Each tensor handed to :class:`StepBackward` is scaled by the micro-batch's share of the
global batch (``n / global_batch``) and by fp16's loss scale before its backward, as
planaria does for a ``TrainSpec.loss``: the gradients of however many backwards add up
to the global batch's mean once reduced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from planaria.faults.errors import UserCodeError
from planaria.faults.user_code import user_call

__all__ = ["StepBackward"]


class StepBackward:
    """The ``backward(tensor, retain_graph=False)`` a ``forward_backward`` is handed; one per
    worker, armed again before each micro-batch (:meth:`run`)."""

    __slots__ = ("calls", "device_type", "scaler", "share", "what")

    def __init__(self, *, sharded: bool = False) -> None:
        # What an error raised in the user's function is said to come from.
        self.what = "the forward_backward function" + (
            " (in a sharded replica: FSDP2 frees a forward's gathered parameters after its "
            "backward, so each backward needs a forward of its own, without retain_graph or "
            "autograd.grad(create_graph=True); with those, use workers_per_replica=1)"
            if sharded else "")
        self.share = 0.0
        self.scaler: torch.amp.GradScaler | None = None
        self.device_type: str | None = None
        self.calls = 0

    def __call__(self, tensor: torch.Tensor, *, retain_graph: bool = False) -> None:
        scaled = tensor * self.share
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        if self.device_type is None:
            scaled.backward(retain_graph=retain_graph)
        else:  # the step's forwards run under autocast; a backward never does
            with torch.autocast(self.device_type, enabled=False):
                scaled.backward(retain_graph=retain_graph)
        self.calls += 1

    def run(self, forward_backward: Callable[..., Any], model: Any, batch: Any,
            share: float, scaler: torch.amp.GradScaler | None, autocast_device: str | None
            ) -> tuple[torch.Tensor, dict[str, Any]]:
        """``forward_backward(model, batch, self)``: its loss (a detached tensor) and metrics.

        ``share`` is the micro-batch's share of the global batch; ``autocast_device`` the
        device type the forwards are autocast on (None: full precision)."""
        self.share, self.scaler, self.device_type, self.calls = (
            share, scaler, autocast_device, 0)
        out = user_call(self.what, forward_backward, model, batch, self)
        if self.calls == 0:
            raise UserCodeError(
                "the forward_backward function returned without calling backward: it must "
                "call the backward(tensor) it is handed (its third argument) at least once, "
                "or no gradient is computed; to have planaria run the backward of one "
                "loss, give TrainSpec(loss=...) instead")
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        if not isinstance(loss, torch.Tensor):
            try:
                loss = torch.tensor(float(loss))
            except (TypeError, ValueError) as err:
                raise UserCodeError(
                    f"the forward_backward function returned {type(loss).__name__} as its "
                    "loss: return the loss to log (a float or a scalar tensor), or (loss, "
                    "metrics)") from err
        return loss.detach(), metrics
