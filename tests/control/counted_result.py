"""A result that counts how often it is unpickled in the process that receives it (an
importable module, so that a Ray worker can return one)."""

from __future__ import annotations

UNPICKLED: list[int] = []


def _unpickled(size: int) -> bytes:
    UNPICKLED.append(size)
    return bytes(size)


class Counted:
    def __init__(self, size: int) -> None:
        self.size = size

    def __reduce__(self) -> tuple[object, tuple[int]]:
        return (_unpickled, (self.size,))
