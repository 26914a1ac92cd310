"""The deterministic data plan: which samples each step trains on.

The plan is a stream of epochs, each a permutation of the dataset drawn from
the seed. Step s takes stream positions ``[s*G, (s+1)*G)`` (G the global
batch size), so a batch may straddle two epochs and no sample is ever dropped:
every sample appears exactly once per epoch. The batch of step s depends on
nothing but (seed, dataset size, G, s), which is what makes failures and width
changes invisible to the training: the controller re-runs a failed step with
the same ids, split over however many ranks are live.

The unit of work is the micro-batch: the global batch is G / micro_batch_size
micro-batches with fixed places (micro-batch j holds batch positions
``[j*mbs, (j+1)*mbs)``), and each rank gets whole, contiguous micro-batches.
What a micro-batch computes (its samples, its random stream, its BatchNorm
batch statistics) is then the same at any width.
"""

from __future__ import annotations

import numpy as np

from planaria.config import check
from planaria.data.ledger import Ledger
from planaria.faults.errors import ConfigError

__all__ = ["DataPlan", "Ledger", "micro_batch_ids", "micro_batch_range", "split_micro_batches"]


class DataPlan:
    """Sample ids per step, from a seed."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        check(num_samples >= 1, "num_samples", num_samples, "a dataset with at least one sample")
        if num_samples < global_batch_size:
            raise ConfigError(
                f"dataset has {num_samples} samples, fewer than one global batch "
                f"(global_batch_size={global_batch_size}): use a smaller global_batch_size "
                "or a larger dataset"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._cache: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._cache.get(epoch)
        if perm is None:
            rng = np.random.default_rng([self.seed, epoch])
            perm = rng.permutation(self.num_samples).astype(np.int64)
            self._cache = {epoch: perm, **{k: v for k, v in self._cache.items() if k == epoch - 1}}
        return perm

    def batch(self, step: int) -> np.ndarray:
        """The sample ids of step ``step``'s global batch, in plan order."""
        start = step * self.global_batch_size
        epoch, offset = divmod(start, self.num_samples)
        if offset + self.global_batch_size <= self.num_samples:  # within one epoch: a slice
            return self.permutation(epoch)[offset : offset + self.global_batch_size].copy()
        positions = np.arange(start, start + self.global_batch_size, dtype=np.int64)
        epochs = positions // self.num_samples
        out = np.empty(self.global_batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self.permutation(int(epoch))[positions[mask] % self.num_samples]
        return out

    def position(self, step: int) -> dict[str, int]:
        """The data position after ``step`` steps, for checkpoints and reports."""
        consumed = step * self.global_batch_size
        return {
            "samples_consumed": consumed,
            "epoch": consumed // self.num_samples,
            "offset_in_epoch": consumed % self.num_samples,
        }

    def describe(self) -> dict[str, int]:
        return {
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
        }


def micro_batch_range(num_micro: int, width: int, rank: int) -> tuple[int, int]:
    """(first, count): rank ``rank``'s micro-batches when ``num_micro`` are split over
    ``width`` ranks (contiguous, near-equal, the larger shares first)."""
    check(width >= 1, "width", width, "an integer >= 1")
    check(0 <= rank < width, "rank", rank, f"an integer in [0, {width})")
    base, extra = divmod(num_micro, width)
    return rank * base + min(rank, extra), base + (rank < extra)


def split_micro_batches(ids: np.ndarray, width: int, micro_batch_size: int) -> list[np.ndarray]:
    """Splits a global batch over ``width`` ranks in whole micro-batches (rank order).

    A rank beyond the number of micro-batches gets none (it still takes part
    in the reduction); the job's configuration keeps that from happening.
    """
    num_micro, rest = divmod(len(ids), micro_batch_size)
    check(rest == 0, "ids", len(ids), f"a multiple of micro_batch_size={micro_batch_size}")
    parts = []
    for rank in range(width):
        first, count = micro_batch_range(num_micro, width, rank)
        part = ids[first * micro_batch_size : (first + count) * micro_batch_size]
        parts.append(np.ascontiguousarray(part))
    return parts


def micro_batch_ids(ids: np.ndarray, micro_batches: tuple[int, ...],
                    micro_batch_size: int) -> np.ndarray:
    """The ids of the global batch ``ids``' micro-batches ``micro_batches`` (global numbers,
    in that order), one array: a share that is not contiguous (a step resumed after a
    fault, see :mod:`planaria.worker.kept_work`)."""
    mbs = micro_batch_size
    if not micro_batches:
        return ids[:0].copy()
    return np.concatenate([ids[j * mbs : (j + 1) * mbs] for j in micro_batches])
