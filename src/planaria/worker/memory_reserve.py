"""Memory a dead worker leaves to its replacement on the same node: a worker's optimizer
state in a region of the node's shared memory (``RunConfig.joiner_memory_reserve``): a
joiner's carved out of it at its setup, another worker's moved into it after its first
step made it (``Commits.claim_state_region``), so that whichever worker dies, the next
joiner finds its memory.

Why. A replacement needs its optimizer state's memory (Adam: twice the parameters)
before it can receive the state. Memory the process takes fresh from the system is
cheap on an idle machine but not beside training: on a virtual machine that gives free
memory back to its host (free page reporting, the default of firecracker and of many
clouds' balloons) each fresh page is a fault on the host too, and beside two computing
workers on 2 cores 680 MB took 3-7 s instead of 0.2 s, the survivors' steps slowed
meanwhile (measured, ``bench/joiner_priority.py``). Pinned host memory for a GPU is
dearer still. The memory the dead worker had is the memory its replacement needs.

How. A region is a file in ``/dev/shm`` (``planaria-reserve-<uid>-<job>-<k>``). A process
claims one with an exclusive ``flock``, which the kernel releases when the process
ends, however it ends; it grows the region with ``posix_fallocate`` (the pages are
allocated then, and a full ``/dev/shm`` is an error here, not a ``SIGBUS`` later)
and maps it shared. When its owner dies the region keeps its pages (tmpfs pages are
never free memory), so the next claimant maps memory already there: page-table
entries, no allocation. Free regions are claimed before new ones, the big enough
first. At the job's end the controller removes its regions on every node it used
(:func:`sweep`), on its own node again once what Ray left is killed (workers orphaned
by a dead raylet or GCS hold theirs until then). A killed controller's reaper removes
those on the controller's node (:func:`pattern`, planaria.control.reaper); on the other
nodes of a cluster they stay until the node restarts (``rm /dev/shm/planaria-reserve-*``
when no job runs there).

Without ``/dev/shm``, or with too little of it, :func:`claim` answers None and the
caller allocates as before. The values a region holds are garbage (the last owner's
state): a joiner's state is always received or restored over them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

__all__ = ["RESERVE_DIR", "Region", "claim", "pattern", "region_bytes", "sweep"]

_log = logging.getLogger(__name__)

RESERVE_DIR = Path("/dev/shm")
_ALIGN = 64


def _prefix(tag: str) -> str:
    return f"planaria-reserve-{os.getuid()}-{tag}-"


def pattern(tag: str, directory: Path = RESERVE_DIR) -> str:
    """The glob pattern of job ``tag``'s regions on a node (what its reaper removes once the
    job's processes are dead: planaria.control.reaper)."""
    return str(directory / (_prefix(tag) + "*"))


@dataclass
class Region:
    """A claimed region: its file, the descriptor holding the claim, its mapped bytes."""

    path: Path
    fd: int
    storage: torch.UntypedStorage
    recycled: bool
    """Its pages were there already (a dead owner's), not taken fresh."""
    used: int = 0

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The next ``shape``/``dtype`` tensor of the region (its values: garbage)."""
        start, end = _span(self.used, shape, dtype)
        if end > self.storage.nbytes():
            raise ValueError(f"region {self.path} is full ({self.storage.nbytes()} bytes)")
        self.used = end
        flat = torch.empty(0, dtype=torch.uint8).set_(self.storage, start, (end - start,), (1,))
        return flat.view(dtype).view(shape)


_held: list[Region] = []


def _forget_claims_in_child() -> None:
    """In a child forked from a claimant (a data loader's worker, a user's process): its
    copies of the claims' descriptors are closed, or the claims would outlive their
    owner as long as the child lives (an ``flock`` belongs to the open file, which a fork
    shares). Closing a copy leaves the parent's claim as it is; the mappings stay."""
    for region in _held:
        with contextlib.suppress(OSError):
            os.close(region.fd)
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_claims_in_child)


def _span(used: int, shape: torch.Size, dtype: torch.dtype) -> tuple[int, int]:
    """Where the next tensor after ``used`` bytes starts (aligned) and ends."""
    start = -(-used // _ALIGN) * _ALIGN
    return start, start + math.prod(shape) * dtype.itemsize


def region_bytes(shapes: list[tuple[torch.Size, torch.dtype]]) -> int:
    """The bytes :meth:`Region.take` needs for ``shapes`` in that order."""
    used = 0
    for shape, dtype in shapes:
        used = _span(used, shape, dtype)[1]
    return used


def _candidates(directory: Path, prefix: str, nbytes: int) -> list[Path]:
    """Existing regions, the big enough first (smallest first), then the others."""
    sized = []
    for path in directory.glob(prefix + "*"):
        with contextlib.suppress(OSError):
            sized.append((path.stat().st_size, path))
    fits = sorted((s, p) for s, p in sized if s >= nbytes)
    short = sorted(((s, p) for s, p in sized if s < nbytes), reverse=True)
    return [p for _, p in fits + short]


def _lock(path: Path, *, create: bool) -> int | None:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _touch(storage: torch.UntypedStorage, had: int) -> None:
    """Maps every page of ``storage`` into this process now, off the critical path, not when
    the state lands on it (beside a step): the ``had`` bytes the region held already by
    reading a byte a page (a minor fault each: the page is there, and a shared mapping of
    tmpfs maps it writable), the rest by zeroing it (new pages, allocated here)."""
    nbytes = storage.nbytes()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
    kept = min(had, nbytes)
    whole[:kept:os.sysconf("SC_PAGE_SIZE")].sum()
    whole[kept:].zero_()


def claim(nbytes: int, tag: str, directory: Path = RESERVE_DIR) -> Region | None:
    """A region of job ``tag`` of at least ``nbytes``, held until this process ends: a free
    one first (a dead owner's), else a new one. None where there is no such directory,
    or it cannot hold ``nbytes`` more."""
    if nbytes <= 0 or not directory.is_dir():
        return None
    prefix = _prefix(tag)
    tried = _candidates(directory, prefix, nbytes)
    index = len(tried)
    while True:
        if tried:
            path, created = tried.pop(0), False
        else:
            path, created = directory / f"{prefix}{index}", True
            index += 1
        fd = _lock(path, create=created)
        if fd is None:
            if created and index > 10_000:
                return None
            continue
        try:
            had = os.fstat(fd).st_size
            if had < nbytes:
                os.posix_fallocate(fd, 0, nbytes)
            storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(
                str(path), shared=True, nbytes=nbytes))
            _touch(storage, had)
        except (OSError, RuntimeError) as exc:
            _log.info("no shared-memory region of %d bytes in %s: %s", nbytes, directory, exc)
            with contextlib.suppress(OSError):
                if created:
                    path.unlink()
            os.close(fd)
            return None
        region = Region(path, fd, storage, recycled=had >= nbytes)
        _held.append(region)
        return region


def sweep(tag: str, wait_s: float = 5.0, directory: Path = RESERVE_DIR) -> int:
    """At the end of job ``tag``: removes its regions in ``directory`` (this node's), a
    region still claimed once its claim ends (its process is being killed), waiting for
    that at most ``wait_s`` in all; returns how many it removed."""
    for region in [r for r in _held if r.path.name.startswith(_prefix(tag))]:
        _held.remove(region)
        os.close(region.fd)  # this process's claim ends here (its mapping stays valid)
    if not directory.is_dir():
        return 0
    removed, deadline = 0, time.monotonic() + wait_s
    left = list(directory.glob(_prefix(tag) + "*"))
    while left:
        for path in list(left):
            fd = _lock(path, create=False)
            if fd is None and path.exists():
                continue
            left.remove(path)
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
            if fd is not None:
                os.close(fd)
        if left and time.monotonic() >= deadline:
            _log.warning("shared-memory regions still claimed, left in place: %s", left)
            break
        if left:
            time.sleep(0.05)
    return removed
