"""A custom step: two backward passes per micro-batch (a loss and a noise-robustness
penalty) and AdamW with no weight decay on biases, as a spec file for ``planaria run``::

    planaria run examples/custom_step.py --replicas 3 --steps 40 --run-dir runs/custom \\
        --chaos kill:w1@step10
"""

from __future__ import annotations

from typing import Any

import torch

from planaria import TrainSpec
from planaria.examples.mlp import Regression, make_model


def forward_backward(model: torch.nn.Module, batch: Any,
                     backward: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Once per micro-batch: each term is a mean over the batch; planaria scales every
    ``backward`` by the micro-batch's share of the global batch."""
    x, y = batch
    main = torch.nn.functional.mse_loss(model(x), y)
    backward(main)
    noisy = x + 0.1 * torch.randn_like(x)  # seeded per micro-batch: the same at any width
    penalty = (model(noisy) - model(x).detach()).pow(2).mean()
    backward(0.1 * penalty)
    return main, {"penalty": penalty.item()}


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """No weight decay on biases and 1-D parameters, as Hugging Face and torchtitan jobs do."""
    plain = [p for n, p in model.named_parameters() if n.endswith("bias") or p.ndim == 1]
    decayed = [p for n, p in model.named_parameters()
               if not (n.endswith("bias") or p.ndim == 1)]
    return torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1},
                              {"params": plain, "weight_decay": 0.0}], lr=1e-3)


spec = TrainSpec(
    model=make_model,
    optimizer=adamw,
    optimizer_gets="model",
    forward_backward=forward_backward,
    dataset=lambda: Regression(n=4096, seed=0),
    global_batch_size=64,
    micro_batch_size=16,
    grad_clip_norm=1.0,
    name="custom-step",
)
