"""Warm worker starts: a per-node server that has imported torch once and forks workers.

A worker process started cold spends ~2 CPU-seconds before it can train: the
interpreter and Ray (~0.3 s), ``import torch`` (~0.85 s) and, on the first
optimizer, ``torch._dynamo`` (~0.75 s: ``Optimizer.add_param_group`` imports it).
On a node whose cores are all training, that time is taken from the training
steps beside it: measured on 2 cores, each spare started cost ~1 s of training.
A fork of a process that has done those imports starts in ~0.3 CPU-seconds (0.7 for
the whole node, Ray's own ``setup_worker.py`` and the launcher included).

How (the pattern of Python's ``forkserver`` and Android's zygote, fitted to Ray's
worker launch): with ``RunConfig.warm_start`` the controller gives each worker
actor a ``runtime_env`` ``py_executable`` that runs
:mod:`planaria.worker._forkserver_launch` in place of Python. That launcher asks this
server, over an abstract Unix socket named after the Ray session and the
environment, to fork a worker with its arguments, environment, directory and
standard streams (passed as file descriptors), starting the server on first use.
The forked child becomes Ray's ``default_worker.py`` exactly as a cold process
would, but with :data:`PRELOAD` already imported. Ray itself is not preloaded:
its C++ configuration reads the environment once per process (the job id among
it), so each child imports it fresh (~0.25 s).

Safety. A fork copies one thread: the server forks only while it has a single
thread and no CUDA context (checked before every fork; else it answers "cold"
and the launcher starts the worker as Ray would; torch's availability checks
are made to ask NVML). The child starts a session of its own (Ray
kills a worker's process group), takes the launcher's environment, reseeds
numpy's global generator (torch's default generator is never drawn from here,
so a child's starts where a cold process's does), and CUDA is never initialised
here. The server exits when the raylet it serves does; a child whose launcher
dies (Ray killed the process it knows) is killed.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import shlex
import signal
import socket
import sys
import time
import traceback

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_forkserver_launch.py")
PRELOAD = ("numpy", "torch", "torch._dynamo", "torch.distributed", "torch.optim")
FORKED_VAR = "PLANARIA_FORKED"  # set in a forked worker's environment: "1"


def py_executable() -> str:
    """The ``runtime_env`` ``py_executable`` that starts a worker through the fork server."""
    return " ".join(shlex.quote(part) for part in (sys.executable, "-S", "-E", LAUNCHER))


def forked() -> bool:
    """True in a worker this server forked."""
    return os.environ.get(FORKED_VAR) == "1"


def single_threaded() -> bool:
    """True when this process has one OS thread (a fork copies only the calling one)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def fork_safe() -> bool:
    """One thread, and no CUDA context (a child could not use it)."""
    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_initialized()
    return single_threaded() and not cuda


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    size = int.from_bytes(head, "big")
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise EOFError("the launcher closed its connection")
        body += chunk
    return json.loads(body), list(fds)


def _become_worker(request: dict, fds: list[int]) -> int:
    """In the forked child: the launcher's process, as Ray started it; returns the exit code."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[FORKED_VAR] = "1"
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python script` has
    import numpy

    numpy.random.seed()  # a cold process draws its own entropy; every child would share ours
    import runpy

    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def serve(address: str, raylet_pid: int) -> None:
    """Imports :data:`PRELOAD`, then forks a worker for each launcher that connects, until
    the raylet exits."""
    t0 = time.time()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:  # the address first: of two launchers' servers, the second leaves at once
        server.bind(address)
    except OSError:
        return
    # numpy's BLAS would start a thread pool of a thread per core here, and a process with
    # threads cannot fork safely; the workers' compute is torch's, whose pools start later.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # A CUDA context does not survive a fork: torch's availability checks during the
    # imports must ask NVML, not initialise CUDA (children initialise it themselves).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    for name in PRELOAD:
        __import__(name)
    gc.freeze()  # the imported objects stay out of the children's collections (and pages)
    server.listen(64)  # launchers that connected before now were refused, and retry
    print(f"planaria fork server {os.getpid()}: {', '.join(PRELOAD)} in {time.time() - t0:.2f} s",
          flush=True)
    # worker pid -> its launcher's connection (None once the launcher is gone)
    children: dict[int, socket.socket | None] = {}
    while _alive(raylet_pid):
        watched = [c for c in children.values() if c is not None]
        readable, _, _ = select.select([server, *watched], [], [], 0.5)
        for conn in readable:
            if conn is server:
                _accept(server, children)
            else:  # a launcher's connection closed: the process Ray knows is gone
                pid = next(p for p, c in children.items() if c is conn)
                conn.close()
                children[pid] = None  # reaped later, with no one to tell
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        _reap(children)


def _accept(server: socket.socket, children: dict[int, socket.socket | None]) -> None:
    conn, _ = server.accept()
    try:
        request, fds = _receive(conn)
    except (OSError, EOFError, ValueError):
        conn.close()
        return
    if not fork_safe():
        print(f"{len(os.listdir('/proc/self/task'))} threads here, or CUDA initialised: a "
              "worker starts cold", flush=True)
        with contextlib.suppress(OSError):
            conn.sendall(b"cold\n")
        conn.close()
        for fd in fds:
            os.close(fd)
        return
    pid = os.fork()
    if pid == 0:
        server.close()
        for other in children.values():
            if other is not None:
                other.close()
        conn.close()
        code = 1
        try:
            code = _become_worker(request, fds)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(f"{pid}\n".encode())
    except OSError:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    children[pid] = conn


def _reap(children: dict[int, socket.socket | None]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


if __name__ == "__main__":
    # Run as a file: its own directory (planaria's modules) must not shadow top-level names.
    sys.path.pop(0)
    serve("\0" + sys.argv[1], int(sys.argv[2]))
