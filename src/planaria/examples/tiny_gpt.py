"""A character-level GPT of a few million parameters, trained on real text found on
every machine: the Python standard library's own source files.

Run it: ``planaria run examples/tiny_gpt.py --replicas 3 --steps 200 --run-dir runs/gpt``
(``planaria demo`` trains it for about a minute and kills a worker partway).
"""

from __future__ import annotations

import math
import sysconfig
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from planaria import TrainSpec

BLOCK = 64  # tokens per sample
VOCAB = 256  # bytes


@lru_cache(maxsize=2)
def corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The first ``max_bytes`` of the stdlib's .py files, in sorted path order, as bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < BLOCK * 1000:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


class CharWindows(Dataset[torch.Tensor]):
    """Non-overlapping windows of BLOCK + 1 bytes; the last 10% are held out for evaluation."""

    def __init__(self, split: str = "train", max_bytes: int = 4_000_000) -> None:
        data = corpus(max_bytes)
        n = (len(data) - 1) // BLOCK
        cut = int(n * 0.9)
        self.data = data
        self.windows = range(0, cut) if split == "train" else range(cut, n)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = self.windows[i] * BLOCK
        return self.data[start : start + BLOCK + 1]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.drop(self.attn(h, h, h, attn_mask=mask, need_weights=False)[0])
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """A small decoder-only transformer. Dropout (none by default) draws from torch's
    generator, which planaria seeds per micro-batch from (seed, step, its index in the
    global batch): every width and every sharding computes the same masks."""

    def __init__(self, dim: int = 256, layers: int = 4, heads: int = 4,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(BLOCK, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        nn.init.normal_(self.pos, std=0.02)
        mask = torch.triu(torch.full((BLOCK, BLOCK), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])  # type: ignore[index]
        return self.head(self.ln(x))


def lm_loss(model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    return loss, {"bits_per_byte": float(loss.detach()) / math.log(2)}


@torch.no_grad()
def evaluate(
    state_dict: dict[str, torch.Tensor],
    *,
    batches: int = 8,
    batch_size: int = 32,
    dim: int = 256,
    layers: int = 4,
) -> float:
    """Mean loss on the held-out split for final weights (e.g. ``FitResult.state_dict``)."""
    model = TinyGPT(dim=dim, layers=layers)
    model.load_state_dict(state_dict)
    model.eval()
    data = CharWindows("eval")
    losses = []
    for b in range(batches):
        idx = range(b * batch_size, min(len(data), (b + 1) * batch_size))
        batch = torch.stack([data[i] for i in idx])
        losses.append(float(lm_loss(model, batch)[0]))
    return sum(losses) / len(losses)


def make_spec(
    *,
    global_batch_size: int = 24,
    micro_batch_size: int = 4,
    seed: int = 0,
    lr: float = 3e-3,
    dim: int = 256,
    layers: int = 4,
    dropout: float = 0.0,
) -> TrainSpec:
    return TrainSpec(
        model=lambda: TinyGPT(dim=dim, layers=layers, dropout=dropout),
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 20)
        ),
        loss=lm_loss,
        dataset=CharWindows,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        grad_clip_norm=1.0,
        seed=seed,
        name="tiny_gpt",
    )


spec = make_spec()
