"""The shared benchmark workload: one model, one dataset, one data order.

planaria and every baseline import this module, so a side-by-side run trains
the same model on the same samples per step with the same global batch. It is
a plain module (torch and numpy only; nothing from planaria at import time),
so torchrun scripts load it by path as well.

The model is a token-wise MLP (``x: (B, T, D)`` → per-token MLP → mean over
tokens → logits), so its compute scales with the tokens per sample while its
state stays small; the ``large`` size instead carries ≥100 MB of state
(parameters + Adam moments) for state-transfer measurements.

Step times, measured on the 2-core CPU box (2 gloo ranks, 1 torch thread each,
global batch 48): see ``SIZES`` and the baselines' reports.

The ``realistic`` size (issue 31's realistic regime: ≥ 1 GB of training state a
replica, steps of about a second) is a recommendation-style model: 16 categorical
fields, each with its own 10,000 x 512 embedding table (81.9M parameters, dense
gradients), then the per-token MLP (512 → 1024 → 1024 → 1024, 2.6M parameters).
84,560,912 parameters; :func:`state_bytes` after a step: 1,014,731,040 B (1.01 GB, 0.945 GiB;
parameters 338 MB + Adam's two moments 676 MB; no buffers); the gradient all-reduced
each step is 338 MB. Adam is the fused one (:data:`FUSED_ADAM_FROM`). Measured with 3
gloo ranks x 1 thread, a step's parts timed apart (barriers between them; the
slowest rank), while the box was loaded by other work (load averages 7.5-20 on 2
cores, so these are upper bounds):

- forward/backward of the 6 micro-batches (2 a rank): 1.5-2.7 s wall; CPU summed
  over the 3 ranks 0.88 s (so about 0.45 s wall on 2 idle cores);
- the gradient all-reduce (one flat 338 MB buffer): 1.6-2.4 s wall, CPU summed
  0.91 s; on the idle box (load 0.2) the same all-reduce of a 369 MB gradient took
  0.755 s, so about 0.69 s at 338 MB;
- Adam (fused): 0.33-0.55 s wall, CPU summed 0.23 s (one process alone, idle: 0.09 s);
- the whole step 3.5-5.7 s at loads 12-20, 2.33 s at load 7.5 (forward/backward 0.99,
  all-reduce 0.95, Adam 0.26 s; ``medium`` beside it: 104-169 ms); DDP
  (``ddp_train.py --size realistic``, 3 ranks, load 11-14): 2.9-5.8 s a step (median
  3.9 s); planaria (3 replicas, ``fit``'s runs, load 18-28): 2.6 and 3.6 s.

So about 1.2 s a step on the idle box (0.45 + 0.69 + 0.14 s; compute about 40% of it,
the all-reduce most of the rest): the CPU the parts take is the same at every load
(forward/backward 0.88 s summed at loads 7.5 to 20). The ``medium`` size run beside
it (104-257 ms a step under those loads, 23 ms idle) scales to 0.4-0.53 s, an
underestimate: the load slows ``medium``'s small operations more than
``realistic``'s large ones. To be measured again on the idle box. Peak resident
memory (``VmHWM``) a process: DDP rank 2.38 GB (its buckets copy the gradient),
planaria worker 1.79 GB (no checkpoint in that run), the timing script 2.1-2.25 GB:
parameters, gradients and Adam's moments are 1.35 GB of tensors, a checkpoint snapshot
of the state 1.01 GB more; 4 processes (3 + a spare) at 2.4 + 1.0 GB fit in the 24 GiB
box when nothing else runs.

Gradient convention: :func:`loss_fn` returns the *sum* of per-sample losses;
a trainer divides by the global batch size before (or after) summing over
ranks, so the gradient is "sum over the global batch ÷ its size" whatever the
number of ranks and micro-batches.

The data order (:func:`batch_ids`, :func:`split_ids`) is the same algorithm as
``planaria.data.plan`` (a permutation per epoch drawn from
``numpy.random.default_rng([seed, epoch])``; step s takes stream positions
``[s*G, (s+1)*G)``; ranks take contiguous near-equal parts). planaria gives each
rank whole micro-batches (so that randomness is width-invariant); with G/micro
= 6 micro-batches, at 1, 2 and 3 ranks that is the same split as here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

__all__ = [
    "DATASET_SIZE",
    "FUSED_ADAM_FROM",
    "GLOBAL_BATCH",
    "MICRO_BATCH",
    "SEED",
    "SIZES",
    "Size",
    "SyntheticDataset",
    "TokenMLP",
    "batch_ids",
    "collate",
    "load_batch",
    "loadavg",
    "loss_fn",
    "make_dataset",
    "make_model",
    "make_optimizer",
    "micro_batches",
    "split_ids",
    "state_bytes",
]

GLOBAL_BATCH = 48
"""Samples per optimizer step, over all ranks (6 micro-batches: even at 1, 2 and 3 ranks)."""
MICRO_BATCH = 8
"""Largest forward/backward chunk a rank runs at once (gradient accumulation)."""
DATASET_SIZE = 4096
"""Samples in the benchmark dataset (64 steps per epoch at the global batch)."""
SEED = 0
"""Seed of the model init, the dataset and the data order."""


@dataclass(frozen=True, kw_only=True)
class Size:
    """Shape of one benchmark model size."""

    tokens: int
    """Tokens per sample (T)."""
    dim: int
    """Input feature width per token (D)."""
    hidden: int
    """Hidden width of the per-token MLP."""
    layers: int
    """Hidden→hidden blocks."""
    classes: int = 16
    """Output classes."""
    vocab: int = 0
    """Rows of each field's embedding table (0: none). With tables, a sample is ``tokens``
    categorical ids, one per field, each looked up in its field's own table (as in a
    recommendation model): the tables hold most of the state, the MLP does most of the
    compute."""


SIZES: dict[str, Size] = {
    # a few ms per step: smoke tests
    "tiny": Size(tokens=4, dim=32, hidden=64, layers=1),
    # 100-200 ms per step with 2 ranks x 1 thread on the 2-core box (global batch 64)
    "small": Size(tokens=32, dim=128, hidden=512, layers=3),
    # about 100 ms per step with 3 ranks x 1 thread on the 2-core box: the recovery bench
    "medium": Size(tokens=16, dim=128, hidden=512, layers=2),
    # >= 100 MB of state with Adam (params x 3 x 4 bytes): state-transfer runs
    "large": Size(tokens=1, dim=1024, hidden=1536, layers=4),
    # ~10 MB and ~0.9 GB of state with Adam: recovery against state size (bench/recovery.py)
    "state_10mb": Size(tokens=1, dim=512, hidden=512, layers=2),
    "state_1gb": Size(tokens=1, dim=2048, hidden=4096, layers=4),
    # the realistic regime (issue 31): 1.01 GB of training state, about 1.2 s a step with 3
    # replicas x 1 thread on the idle 2-core box (module doc)
    "realistic": Size(tokens=16, dim=512, hidden=1024, layers=2, vocab=10_000),
}


class TokenMLP(nn.Module):
    """Per-token MLP (after the fields' embedding tables, if the size has them),
    mean-pooled over tokens, then a linear classifier head."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        # Dense embedding gradients (not sparse=True): all-reduced and updated whole, as
        # DDP and Adam do. A table per field keeps each gradient small enough for malloc to
        # reuse (one big table's would be a fresh mmap, page-faulted, every backward).
        self.tables = nn.ModuleList(
            nn.Embedding(size.vocab, size.dim) for _ in range(size.tokens if size.vocab else 0))
        blocks: list[nn.Module] = [nn.Linear(size.dim, size.hidden), nn.GELU()]
        for _ in range(size.layers):
            blocks += [nn.Linear(size.hidden, size.hidden), nn.GELU()]
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(size.hidden, size.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.tables):
            x = torch.stack([table(x[:, f]) for f, table in enumerate(self.tables)], dim=1)
        return self.head(self.body(x).mean(dim=1))


def make_model(size: str = "small", seed: int = SEED) -> nn.Module:
    """The benchmark model, initialised identically from ``seed`` on every process."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TokenMLP(SIZES[size])


FUSED_ADAM_FROM = 50_000_000
"""Parameters from which :func:`make_optimizer`'s Adam is the fused one (one pass over the
state; the default loop takes 0.75 s a step for 92M parameters on the 2-core box, 0.1 s
fused): the ``state_1gb`` and ``realistic`` sizes. Below, the default loop, as before."""


def make_optimizer(params, lr: float = 1e-3) -> torch.optim.Optimizer:
    """Adam (two moment tensors per parameter, so state = 3x the parameters); fused from
    :data:`FUSED_ADAM_FROM` parameters."""
    params = list(params)
    fused = sum(p.numel() for p in params) >= FUSED_ADAM_FROM
    return torch.optim.Adam(params, lr=lr, fused=True if fused else None)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of the training state: what a replacement must receive and a checkpoint must
    save. The model's parameters and buffers, plus (if given) the optimizer's tensor state
    (Adam: its two moments and its step count per parameter, there once it has stepped).
    Gradients are not state: each step recomputes them."""
    total = sum(t.numel() * t.element_size()
                for t in (*model.parameters(), *model.buffers()))
    if optimizer is not None:
        for st in optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return total


class SyntheticDataset(torch.utils.data.Dataset):
    """Deterministic classification data: sample i depends only on (seed, i).

    ``x`` is standard normal of shape (T, D); the label is the argmax of a
    fixed random linear "teacher" applied to the token mean, so the task is
    learnable and the loss goes down. With embedding tables, ``x`` is T uniform ids
    (one per field) and the teacher a random score per id and class, summed over the fields.
    """

    def __init__(self, n: int, seed: int, size: Size) -> None:
        self.n, self.seed, self.size = n, seed, size
        g = torch.Generator().manual_seed(seed)
        self.teacher = torch.randn(size.vocab or size.dim, size.classes, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i) + 1)
        if self.size.vocab:  # an id per field; the teacher scores each id
            ids = torch.randint(self.size.vocab, (self.size.tokens,), generator=g)
            return ids, self.teacher[ids].sum(dim=0).argmax()
        x = torch.randn(self.size.tokens, self.size.dim, generator=g)
        y = (x.mean(dim=0) @ self.teacher).argmax()
        return x, y


def make_dataset(n: int = DATASET_SIZE, seed: int = SEED, size: str = "small") -> SyntheticDataset:
    """The benchmark dataset (map-style; ``ds[i] -> (x, y)``)."""
    return SyntheticDataset(n, seed, SIZES[size])


def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*samples, strict=True)
    return torch.stack(xs), torch.stack(ys)


def load_batch(dataset, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacks the samples ``ids`` of ``dataset`` into one batch ``(x, y)``."""
    return collate([dataset[int(i)] for i in ids])


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Sum (not mean) of per-sample cross-entropy; divide by the global batch size."""
    x, y = batch
    return nn.functional.cross_entropy(model(x), y, reduction="sum")


def batch_ids(
    step: int, global_batch: int = GLOBAL_BATCH, n: int = DATASET_SIZE, seed: int = SEED
) -> np.ndarray:
    """Sample ids of step ``step``'s global batch (same as ``planaria.data.plan``)."""
    start = step * global_batch
    positions = np.arange(start, start + global_batch, dtype=np.int64)
    epochs = positions // n
    out = np.empty(global_batch, dtype=np.int64)
    for epoch in np.unique(epochs):
        mask = epochs == epoch
        perm = np.random.default_rng([seed, int(epoch)]).permutation(n)
        out[mask] = perm[positions[mask] % n]
    return out


def split_ids(ids: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank ``rank``'s contiguous, near-equal part of ``ids`` (np.array_split order)."""
    return np.array_split(ids, world)[rank]


def micro_batches(ids: np.ndarray, micro: int = MICRO_BATCH) -> list[np.ndarray]:
    """Chunks of at most ``micro`` ids (an empty list for no ids)."""
    return [ids[i : i + micro] for i in range(0, len(ids), micro)]


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages (``n/a`` where /proc has none): printed beside
    every figure, since these machines are shared and noisy."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"
