"""An MLP with BatchNorm and dropout: randomness and module buffers, for the data tests.

Run it: ``planaria run examples/bn_mlp.py --replicas 3 --steps 50 --run-dir runs/bn``.
"""

from __future__ import annotations

import torch
from torch import nn

from planaria import TrainSpec
from planaria.examples.mlp import Regression, mse


def make_model(dim: int = 32, hidden: int = 64, dropout: float = 0.2) -> nn.Module:
    # No bias before a BatchNorm: its gradient is zero up to rounding, which Adam would
    # amplify into steps of size lr, so that runs differing only in summation order drift.
    return nn.Sequential(
        nn.Linear(dim, hidden, bias=False),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden, bias=False),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, 1),
    )


def make_spec(
    *,
    n: int = 4096,
    global_batch_size: int = 64,
    micro_batch_size: int = 16,
    seed: int = 0,
    lr: float = 1e-2,
    dropout: float = 0.2,
) -> TrainSpec:
    return TrainSpec(
        model=lambda: make_model(dropout=dropout),
        optimizer=lambda params: torch.optim.Adam(params, lr=lr),
        loss=mse,
        dataset=lambda: Regression(n=n, seed=seed),
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        grad_clip_norm=1.0,
        seed=seed,
        name="bn_mlp",
    )


spec = make_spec()
