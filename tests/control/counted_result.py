"""A result that counts how often it is unpickled in the process that receives it (an
importable module, so that a Ray worker can return one)."""

from __future__ import annotations

import threading

UNPICKLED: list[int] = []
STARTED = threading.Event()  # an unpickling has begun (in the receiving process)
RELEASE = threading.Event()  # cleared: the unpickling waits until it is set
RELEASE.set()


def _unpickled(size: int) -> bytes:
    STARTED.set()
    RELEASE.wait()
    UNPICKLED.append(size)
    return bytes(size)


class Counted:
    def __init__(self, size: int) -> None:
        self.size = size

    def __reduce__(self) -> tuple[object, tuple[int]]:
        return (_unpickled, (self.size,))
