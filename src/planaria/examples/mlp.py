"""A small, fast MLP regression spec: what the tests train.

Run it: ``planaria run examples/mlp.py --replicas 3 --steps 50 --run-dir runs/mlp``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from planaria import TrainSpec


class Regression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """y = sin(x·w / sqrt(dim)) + noise, with fixed random inputs: deterministic from the seed."""

    def __init__(self, n: int = 4096, dim: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        w = torch.randn(dim, 1, generator=g)
        self.y = torch.sin(self.x @ w / dim**0.5) + 0.05 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_model(dim: int = 32, hidden: int = 128) -> nn.Module:
    return nn.Sequential(
        nn.Linear(dim, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, 1),
    )


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def make_spec(
    *,
    n: int = 4096,
    global_batch_size: int = 64,
    micro_batch_size: int = 16,
    seed: int = 0,
    lr: float = 1e-2,
) -> TrainSpec:
    return TrainSpec(
        model=make_model,
        optimizer=lambda params: torch.optim.Adam(params, lr=lr),
        loss=mse,
        dataset=lambda: Regression(n=n, seed=seed),
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        grad_clip_norm=1.0,
        seed=seed,
        name="mlp",
    )


spec = make_spec()
