"""What a worker knows of its process and its machine: Ray's ids, its address, its threads."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor

import ray

from planaria.wire.interfaces import interface_address
from planaria.wire.probes import LinkReport, local_endpoints, probe, stalled_connections

__all__ = [
    "MALLOC_MMAP_THRESHOLD",
    "MALLOC_TRIM_THRESHOLD",
    "gcs_address",
    "group_address",
    "keep_freed_memory",
    "nccl_survives_errors",
    "probe_peers",
    "ray_node_id",
    "thread_stacks",
]


MALLOC_MMAP_THRESHOLD = 32 << 20
"""Blocks below this come from malloc's heaps (glibc's own ceiling for its adaptive one)."""
MALLOC_TRIM_THRESHOLD = 256 << 20
"""Free memory a heap keeps at its top before it is given back to the system."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


def keep_freed_memory() -> bool:
    """glibc's malloc keeps the memory a step frees for the next step.

    The steps run on a thread of their own (Ray's), whose malloc arena gives freed memory
    back to the system as soon as its top is free, and takes it again, page by page,
    on the next allocation: measured, ~1,000 page faults a second in a ``small``-model
    worker (30 in a DDP rank, which trains on its main thread), and steps 2-3 ms slower
    of ~60 than with the thresholds fixed. With them fixed the memory is kept (as in a
    process's main arena once warm). Not where the user set either threshold (``MALLOC_*_`` in the
    environment) or glibc is not the C library; returns whether it was set."""
    if os.environ.get("MALLOC_TRIM_THRESHOLD_") or os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        # The mmap threshold first: setting either one fixes both (no adaptive thresholds).
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
                    and libc.mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))
    except (OSError, AttributeError):  # not glibc (macOS, musl): its own allocator's ways
        return False


def nccl_survives_errors() -> None:
    """torch's default NCCL error handling tears the process down when a collective times
    out or a communicator fails: here a survivor must live on, its group aborted, and
    rejoin the next generation. Set before the first NCCL group is built; a user's own
    setting wins."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # abort comms, keep process
    os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")  # no kill from the heartbeat
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")


def group_address() -> str:
    """The address this worker's process groups use: the interface gloo is told to use, or
    what the host name resolves to (as gloo does)."""
    name = os.environ.get("GLOO_SOCKET_IFNAME")
    if name:
        with contextlib.suppress(Exception):
            return interface_address(name.split(",")[0])
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def ray_node_id() -> str | None:
    try:
        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # not in a Ray worker (a test calling the class directly)
        return None


def gcs_address() -> str | None:
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:
        return None


def probe_peers(peers: dict[str, str], timeout_s: float) -> LinkReport:
    """Which of ``peers`` (name → probe address) answer, and this process's TCP connections
    whose bytes go unacked (planaria.control.links)."""
    with ThreadPoolExecutor(max_workers=max(1, len(peers))) as pool:
        reached = dict(zip(peers, pool.map(lambda a: probe(a, timeout_s), peers.values()),
                           strict=True))
    return LinkReport(reached=reached, stalled=tuple(stalled_connections()),
                      endpoints=tuple(local_endpoints()))


def thread_stacks() -> str:
    """Every thread's Python stack."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in frames.items():
        parts.append(
            f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
        )
    return "\n".join(parts)
