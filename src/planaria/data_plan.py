"""The deterministic data plan: which samples each step trains on.

The plan is a stream of epochs, each a permutation of the dataset drawn from
the seed. Step s takes stream positions ``[s*G, (s+1)*G)`` (G the global
batch size), so a batch may straddle two epochs and no sample is ever dropped:
every sample appears exactly once per epoch. The batch of step s depends on
nothing but (seed, dataset size, G, s), which is what makes failures and width
changes invisible to the training: the controller re-runs a failed step with
the same ids, split over however many ranks are live.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from planaria.config import check
from planaria.errors import ConfigError

__all__ = ["DataPlan", "Ledger", "split_contiguous"]


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


def split_contiguous(ids: np.ndarray, width: int) -> list[np.ndarray]:
    """Splits ids over ``width`` ranks in contiguous, near-equal parts (rank order)."""
    check(width >= 1, "width", width, "an integer >= 1")
    return [np.ascontiguousarray(part) for part in np.array_split(ids, width)]


class Ledger:
    """Opt-in record of the sample ids each committed step trained on (``ledger.jsonl``).

    The ids come from the workers' own reports of what they loaded, not from
    what the controller meant to send, so the ledger checks the real thing.
    """

    FILE = "ledger.jsonl"

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / self.FILE
        self._file = self.path.open("a", encoding="utf-8")

    def record(self, step: int, ids: list[int], *, skipped: bool = False) -> None:
        entry: dict[str, Any] = {"step": step, "ids": ids}
        if skipped:
            entry["skipped"] = True
        self._file.write(json.dumps(entry, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    @staticmethod
    def read(run_dir: Path) -> dict[int, list[int]]:
        """Committed steps → ids; a step recorded twice (resumed past a crash) keeps the last."""
        out: dict[int, list[int]] = {}
        path = Path(run_dir) / Ledger.FILE
        with path.open(encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a crash
                out[int(entry["step"])] = [int(i) for i in entry["ids"]]
        return out
