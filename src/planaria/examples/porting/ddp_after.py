"""The same training as ddp_before.py, on planaria (the "after" of docs/porting.md).
Run: planaria run ddp_after.py --replicas 3 --steps 200 --run-dir runs/ported
--chaos kill:w1@step50"""

import torch
from torch.utils.data import TensorDataset

from planaria import TrainSpec

STEPS, GLOBAL_BATCH = 200, 48


def make_dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    return TensorDataset(x, x @ torch.randn(32, 1, generator=g))


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


spec = TrainSpec(
    model=make_model,
    dataset=make_dataset,
    loss=loss,
    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
    lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10)),
    grad_clip_norm=1.0,
    global_batch_size=GLOBAL_BATCH,
    micro_batch_size=16,
    seed=0,
    name="ported-ddp",
)
