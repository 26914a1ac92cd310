"""Every committed step's loss, in compact storage: 16 bytes a step (a million steps: 16 MB)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

__all__ = ["LossHistory"]


class LossHistory(Sequence[tuple[int, float]]):
    """(step, loss) pairs, in commit order, in two growing arrays (int64 steps, float64
    losses) instead of a list of tuples (~120 bytes each). Reads as a sequence of tuples;
    :attr:`steps` and :attr:`values` are the arrays themselves (views, no copy)."""

    def __init__(self, pairs: Any = ()) -> None:
        self._steps = np.empty(1024, dtype=np.int64)
        self._values = np.empty(1024, dtype=np.float64)
        self._n = 0
        for step, loss in pairs:
            self.append((step, loss))

    def append(self, pair: tuple[int, float]) -> None:
        if self._n == len(self._steps):  # doubling: amortised O(1) per step
            self._steps = np.resize(self._steps, 2 * self._n)
            self._values = np.resize(self._values, 2 * self._n)
        self._steps[self._n], self._values[self._n] = int(pair[0]), float(pair[1])
        self._n += 1

    @property
    def steps(self) -> np.ndarray:
        return self._steps[: self._n]

    @property
    def values(self) -> np.ndarray:
        return self._values[: self._n]

    @property
    def nbytes(self) -> int:
        """Memory held (with the room to grow)."""
        return int(self._steps.nbytes + self._values.nbytes)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> tuple[int, float]: ...

    @overload
    def __getitem__(self, index: slice) -> list[tuple[int, float]]: ...

    def __getitem__(self, index: int | slice) -> tuple[int, float] | list[tuple[int, float]]:
        if isinstance(index, slice):
            return list(zip(self.steps[index].tolist(), self.values[index].tolist(), strict=True))
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError(f"loss history index {index} out of range ({self._n} steps)")
        return int(self._steps[index]), float(self._values[index])

    def __iter__(self) -> Iterator[tuple[int, float]]:
        return iter(zip(self.steps.tolist(), self.values.tolist(), strict=True))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LossHistory):
            return bool(np.array_equal(self.steps, other.steps)
                        and np.array_equal(self.values, other.values, equal_nan=True))
        if isinstance(other, Sequence):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        tail = f", ..., {self[-1]}" if self._n > 1 else ""
        return f"LossHistory({self._n} steps{': ' + str(self[0]) if self._n else ''}{tail})"
