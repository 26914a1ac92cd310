"""A process that keeps a worker's memory after the worker dies, so that its death is heard
before its memory is torn down (docs/design.md, "A death heard before its memory goes").
The standard library alone: the fork server loads this file by its path
(:mod:`planaria.worker.forkserver`)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

_CLONE_VM = 0x100
_SYS_PAUSE_X86_64 = 34
_PR_SET_CHILD_SUBREAPER = 36


_holder_stack: list[object] = []  # the holder's stack: this process's memory, kept


def start_memory_holder() -> int | None:
    """Starts a process that shares this one's memory and does nothing else (``clone(2)``
    with ``CLONE_VM``, blocked in ``pause``, every signal blocked); returns its pid, or None
    where it cannot (not x86-64 Linux with glibc, or the call failed).

    Why: Linux tears a dying process's memory down before it closes its files (``do_exit``:
    ``exit_mm`` before ``exit_files``), so the peers of a SIGKILLed worker holding 1.8 GB
    heard of its death 0.2 s after the kill on a busy 2-core node (0.11 s idle), the
    teardown's time. While another process shares the memory the dying one only drops its
    reference, and its files close at once; the holder's own death tears it down after.

    Call it in a single-threaded process before it opens anything a peer watches (the
    holder keeps a copy of every file descriptor open at the call) and before CUDA. Whoever
    reaps this process kills its process group (the holder is in it): the fork server, or
    the launcher if the server is gone."""
    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        return None
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        clone = libc.clone
    except (OSError, AttributeError):  # not glibc
        return None
    clone.restype = ctypes.c_int
    clone.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    stack = ctypes.create_string_buffer(64 << 10)
    top = (ctypes.addressof(stack) + len(stack)) & ~15
    # The child runs glibc's syscall(SYS_pause) on its own stack: no Python, no locks, no
    # thread-local state; with every signal blocked it never returns (SIGKILL ends it).
    entry = ctypes.cast(libc.syscall, ctypes.c_void_p)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = clone(entry, top, _CLONE_VM | signal.SIGCHLD, _SYS_PAUSE_X86_64)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    if pid <= 0:
        return None
    _holder_stack.append(stack)
    return pid


def kill_group(pid: int) -> None:
    """SIGKILLs what is left of the process group ``pid`` leads (a forked worker's: its
    memory holder, its children), once the worker itself is gone."""
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def set_child_subreaper() -> None:
    """Orphans of this process's descendants (a dead worker's holder) become its children."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
