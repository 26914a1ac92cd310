"""The process Ray starts for a planaria worker when warm starts are on (see
planaria.worker.forkserver).

Ray runs ``<python> -S -E <this file> <default_worker.py> <its arguments>`` (the
actor's ``runtime_env`` ``py_executable``). This file imports the standard library
alone (it must cost ~20 ms, not torch's second): it asks the node's fork server to
fork a worker with these arguments, its environment, its directory and its
standard streams, starting the server first if there is none, then stays as the
process Ray knows, until the worker exits (with its exit code). Signals it gets
reach the worker; if it is killed, the server kills the worker. Whenever the
server cannot fork (not running and not starting, refusing, gone), this process
becomes the worker itself, cold: exec of the real interpreter, as Ray would have.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import NoReturn

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver.py")
START_WAIT_S = 60.0  # a server's imports take ~2 s idle; much longer on a loaded node
# The environment a server's preloaded modules may have read: a worker whose values
# differ gets a server of its own.
KEY_VARS = ("PYTHONPATH", "PYTHONHASHSEED", "LD_PRELOAD", "LD_LIBRARY_PATH", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAY_JOB_ID", "VIRTUAL_ENV")
DISABLE_VAR = "PLANARIA_FORKSERVER"  # "0": every worker starts cold
# A worker's own settings, read by the forked child: not the server's (forkserver.py).
PER_WORKER_VARS = ("PLANARIA_START_PRIORITY", "PLANARIA_MEMORY_HOLDER")


def _arg(argv: list[str], name: str) -> str:
    for a in argv:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return ""


def server_address(argv: list[str], env: dict[str, str], cwd: str) -> str:
    """The abstract Unix socket of the server for this Ray session and environment."""
    key = {"python": sys.executable, "session": _arg(argv, "session-name"), "cwd": cwd,
           **{k: env.get(k, "") for k in KEY_VARS},
           **{k: v for k, v in env.items()
              if k.startswith(("TORCH_", "PLANARIA_")) and k not in PER_WORKER_VARS}}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return f"\0planaria-forkserver-{digest}"


def _cold(argv: list[str]) -> NoReturn:
    os.execv(sys.executable, [sys.executable, *argv])


def _connect(address: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(address)
        return s
    except OSError:
        s.close()
        return None


def _start_server(address: str, argv: list[str]) -> None:
    """Starts a server in a session of its own (Ray kills a worker's process group); two
    launchers racing both start one, and the second to bind its address exits."""
    log = os.devnull
    temp, session = _arg(argv, "temp-dir"), _arg(argv, "session-name")
    if temp and session and os.path.isdir(os.path.join(temp, session, "logs")):
        log = os.path.join(temp, session, "logs", f"planaria-forkserver-{address[-20:]}.log")
    raylet = os.environ.get("RAY_RAYLET_PID") or str(os.getppid())  # Ray started this process
    with open(log, "ab") as out:
        subprocess.Popen(
            [sys.executable, SERVER, address[1:], raylet],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
            close_fds=True,
        )


def main(argv: list[str]) -> None:
    if os.environ.get(DISABLE_VAR) == "0":
        _cold(argv)
    cwd = os.getcwd()
    env = dict(os.environ)
    address = server_address(argv, env, cwd)
    conn = _connect(address)
    if conn is None:
        _start_server(address, argv)
        deadline = time.monotonic() + START_WAIT_S
        while conn is None and time.monotonic() < deadline:
            time.sleep(0.05)
            conn = _connect(address)
    if conn is None:
        _cold(argv)
    body = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
    try:
        socket.send_fds(conn, [len(body).to_bytes(8, "big")], [0, 1, 2])
        conn.sendall(body)
        reply = conn.makefile("rb")
        first = reply.readline().strip()
    except OSError:
        first = b""
    if not first.isdigit():  # refused ("cold") or the server died: start as Ray would
        conn.close()
        _cold(argv)
    child = int(first)

    def forward(sig: int, _frame: object) -> None:
        with contextlib.suppress(OSError):
            os.kill(child, sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    line = reply.readline()  # the worker's exit code, once it exits
    if not line.strip():  # the server is gone: so is the worker (and its memory holder)
        with contextlib.suppress(OSError):
            os.killpg(child, signal.SIGKILL)
    code = int(line) if line.strip().lstrip(b"-").isdigit() else 1
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main(sys.argv[1:])
