"""A Lightning module and datamodule, unchanged, trained elastic by planaria.

Run it (needs ``pip install ".[lightning]"``), killing a worker partway::

    python examples/lightning_module.py --replicas 3 --steps 60 --chaos kill:w1@step20

Before, with Lightning's ``Trainer`` (one device, micro-batches of 32 accumulated 4 times)::

    trainer = pl.Trainer(max_steps=60, accumulate_grad_batches=4, gradient_clip_val=1.0)
    trainer.fit(LitClassifier(), datamodule=Spirals())

After, on three replicas that survive a kill, with the same global batch of 128::

    fit_lightning(LitClassifier, datamodule=Spirals, global_batch_size=128,
                  micro_batch_size=32, grad_clip_norm=1.0, steps=60, replicas=3,
                  run_dir="runs/lightning", chaos="kill:w1@step20")
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytorch_lightning as pl  # or: import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from planaria.integrations.lightning import fit_lightning


class SpiralPoints(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Three interleaved spirals in the plane, with noise: a map-style dataset."""

    def __init__(self, n: int = 3072, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.arange(n) % 3
        r = torch.rand(n, generator=g)
        angle = 4 * r + self.y * (2 * math.pi / 3) + 0.2 * torch.randn(n, generator=g)
        self.x = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Spirals(pl.LightningDataModule):
    def setup(self, stage: str) -> None:
        self.train = SpiralPoints()

    def train_dataloader(self) -> DataLoader[Any]:
        # Under planaria the plan batches and orders the samples: batch_size and shuffle
        # here are what Lightning alone would use.
        return DataLoader(self.train, batch_size=32, shuffle=True)


class LitClassifier(pl.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 3e-2, warmup_steps: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                 nn.Tanh(), nn.Linear(hidden, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", (logits.argmax(dim=1) == y).float().mean())
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.01)
        warmup = self.hparams["warmup_steps"]
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--chaos", default=None, help="faults to inject, e.g. kill:w1@step20")
    parser.add_argument("--run-dir", default="runs/lightning")
    args = parser.parse_args(argv)
    last: dict[str, float] = {}
    result = fit_lightning(
        LitClassifier, datamodule=Spirals, global_batch_size=128, micro_batch_size=32,
        grad_clip_norm=1.0, steps=args.steps, replicas=args.replicas, run_dir=args.run_dir,
        chaos=args.chaos, on_step=lambda step: last.update(step.metrics))
    step, loss = result.losses[-1]
    print(f"trained {result.final_step} steps; step {step}: loss {loss:.4f}, "
          f"train_acc {last.get('train_acc', float('nan')):.3f}; events: {result.events_path}")
    module = LitClassifier()
    module.load_state_dict(result.state_dict)  # the trained module, as Lightning would leave it
    return last


if __name__ == "__main__":
    main()
