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
it), so each child imports it fresh (~0.25 s). What else a worker's ``import ray``
and its connection import (:data:`OPTIONAL_PRELOAD`: Ray's dependencies, pydantic and
starlette for its serializers) is preloaded where installed. planaria's own modules
import Ray, so they cannot be imported here; their code is compiled here instead
(:class:`CompiledSources`): a child imports them without reading or compiling a
source file. Without that, a worker compiles all of them on every start wherever no
``.pyc`` can be written or read (``PYTHONDONTWRITEBYTECODE``, common in container
images, or a read-only install): ~0.3 CPU-seconds a start.

A joiner's start at low priority. A replacement or spare usually starts on cores that
training workers use (a node with a free slot, a spare beside its peers). Its start
(Ray's connection, its imports) is ~1 CPU-second taken from their steps. With
:data:`START_PRIORITY_VAR` set to ``"idle"`` in its environment (the controller sets it
for joiners under ``RunConfig.joiner_setup_priority="idle"``) the forked process starts
under ``SCHED_IDLE`` and takes only the CPU the steps leave; its actor sets every thread
back to the ordinary policy as it is made (:func:`end_low_priority_start`), keeping
their nice values. Only where the process may set them back (root, ``CAP_SYS_NICE``, or
an ``RLIMIT_NICE`` covering its nice value: sched(7)); elsewhere it starts as before.
Ray's own part of the start (``setup_worker.py``, before the launcher) is Ray's.

A forked worker leads a session of its own, and where the kernel groups processes by
session (``CONFIG_SCHED_AUTOGROUP``, on where tasks sit in the root CPU cgroup: sched(7))
each session is a scheduling group that competes with the others at its group's weight:
a thread's ``SCHED_IDLE`` or nice value then weighs only within its own process.
Measured on 2 cores: a ``SCHED_IDLE`` loop in a session of its own halved a nice-15 loop
on its core (0.232 s against 0.128 for the same work), in the worker's session it cost 6 %,
in a group set to nice 19 nothing. So a joiner started low also sets its session's group
to nice 19 (:data:`START_GROUP_VAR`; raising a nice value needs no privilege) and puts it
back to 0 when its setup ends (:func:`end_low_priority_setup`): its start, model,
optimizer state and warm-up take the CPU training leaves, on any kernel.

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
import errno
import gc
import importlib.machinery
import importlib.util
import json
import os
import select
import shlex
import signal
import socket
import sys
import time
import traceback
from types import ModuleType

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_forkserver_launch.py")
PRELOAD = ("numpy", "torch", "torch._dynamo", "torch.distributed", "torch.optim")
# What a worker's ``import ray`` and its connection import besides Ray (its dependencies;
# pydantic and starlette for its serializers, ray.util.serialization_addons), where
# installed: none starts a thread.
OPTIONAL_PRELOAD = ("pydantic", "pydantic.main", "starlette.datastructures", "requests",
                    "google.protobuf.message", "jsonschema", "yaml", "filelock", "psutil",
                    "msgpack", "wcwidth")
COMPILED_PACKAGE = "planaria"  # whose modules' code the server compiles for its children
FORKED_VAR = "PLANARIA_FORKED"  # set in a forked worker's environment: "1"
START_PRIORITY_VAR = "PLANARIA_START_PRIORITY"  # "idle": a joiner, started under SCHED_IDLE
START_GROUP_VAR = "PLANARIA_START_GROUP"  # "nice 19": its session's group set low at fork
AUTOGROUP = "/proc/self/autogroup"  # this session's scheduling group (sched(7): autogroup)
MEMORY_HOLDER_VAR = "PLANARIA_MEMORY_HOLDER"  # "1": the forked worker starts a memory holder


def _load_sibling(name: str) -> ModuleType:
    """A standard-library-only module beside this file, loaded by its path: this file runs
    as a script in the server, where planaria's package (which imports Ray) is not."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_planaria_forkserver{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_holder = _load_sibling("_memory_holder")
start_memory_holder = _holder.start_memory_holder
kill_group = _holder.kill_group


def py_executable() -> str:
    """The ``runtime_env`` ``py_executable`` that starts a worker through the fork server."""
    return " ".join(shlex.quote(part) for part in (sys.executable, "-S", "-E", LAUNCHER))


def forked() -> bool:
    """True in a worker this server forked."""
    return os.environ.get(FORKED_VAR) == "1"


def may_raise_priority() -> bool:
    """Whether this process may set a thread of its own from ``SCHED_IDLE`` back to the
    ordinary policy (sched(7)): as root, with ``CAP_SYS_NICE``, or with an ``RLIMIT_NICE``
    that covers its nice value."""
    if not sys.platform.startswith("linux"):
        return False
    if os.geteuid() == 0:
        return True
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:") and int(line.split()[1], 16) >> 23 & 1:
                return True
    import resource

    limit = resource.getrlimit(resource.RLIMIT_NICE)[0]
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    return limit == resource.RLIM_INFINITY or 20 - nice <= limit


def end_low_priority_start() -> str:
    """In a worker started under ``SCHED_IDLE`` (:data:`START_PRIORITY_VAR`): sets every
    thread of the process back to the ordinary policy, their nice values kept; returns
    ``"idle"`` if any was idle, else ``"worker"``. Threads started during the start
    inherited the policy, so all are looked at (again, should one be starting meanwhile)."""
    if os.environ.get(START_PRIORITY_VAR) != "idle" or not sys.platform.startswith("linux"):
        return "worker"
    raised = False
    for _ in range(3):
        idle: list[int] = []
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                if os.sched_getscheduler(int(task)) == os.SCHED_IDLE:
                    idle.append(int(task))
        if not idle:
            break
        for tid in idle:
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                raised = True
    return "idle" if raised else "worker"


def set_session_group_nice(nice: int, *, wait_s: float) -> bool:
    """Sets the nice value of this process's session's scheduling group (``AUTOGROUP``)
    where this process leads its session (a forked worker: its group is its own, its
    children's); returns whether it was set. The kernel takes one change a tenth of a
    second across the machine from an unprivileged caller (``EAGAIN``): retried until
    ``wait_s`` has passed. False off Linux, without autogroup, or not a session leader."""
    if not sys.platform.startswith("linux") or os.getsid(0) != os.getpid():
        return False
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(AUTOGROUP, "w") as group:
                group.write(str(nice))
            return True
        except OSError as exc:
            if exc.errno != errno.EAGAIN or time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def end_low_priority_setup() -> str:
    """In a joiner whose session's group was set low at fork (:data:`START_GROUP_VAR`):
    puts it back to nice 0 at the end of its setup; returns what it ran at, ``"nice 19"``,
    or ``"worker"`` where it was not lowered. Putting it back is retried for up to 5 s: a
    worker left in a low group would run every step at that weight."""
    lowered = os.environ.pop(START_GROUP_VAR, None)
    if lowered is None:
        return "worker"
    if not set_session_group_nice(0, wait_s=5.0):
        raise OSError(f"could not set this worker's scheduling group back from {lowered} "
                      f"({AUTOGROUP}): it would train at that priority")
    return lowered


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


class _CachedSourceLoader(importlib.machinery.SourceFileLoader):
    """A source file's loader that takes its code object from :class:`CompiledSources`
    when the file is unchanged (same modification time and size) since it was compiled."""

    def __init__(self, fullname: str, path: str, codes: dict) -> None:
        super().__init__(fullname, path)
        self._codes = codes

    def get_code(self, fullname: str):  # type: ignore[no-untyped-def]
        path = self.get_filename(fullname)
        entry = self._codes.get(path)
        if entry is not None:
            with contextlib.suppress(OSError):
                st = os.stat(path)
                if (st.st_mtime_ns, st.st_size) == entry[:2]:
                    return entry[2]
        return super().get_code(fullname)


class CompiledSources:
    """A ``sys.meta_path`` finder serving one package's modules from code objects compiled
    once, in this process, before its children are forked.

    It finds a module as the finders after it do (the path's, an editable install's) and
    only swaps a source file's loader: a module whose file changed after it was compiled,
    or that is not a source file, loads as usual."""

    def __init__(self, package: str) -> None:
        self.package = package
        self.codes: dict[str, tuple[int, int, object]] = {}
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None or not spec.submodule_search_locations:
            return
        for root in spec.submodule_search_locations:
            for directory, _, files in os.walk(root):
                for name in files:
                    if name.endswith(".py"):
                        self._compile(os.path.join(directory, name))

    def _compile(self, path: str) -> None:
        try:
            st = os.stat(path)
            with open(path, "rb") as f:
                source = f.read()
            # As importlib compiles a source file (SourceLoader.source_to_code).
            code = compile(source, path, "exec", dont_inherit=True, optimize=-1)
        except (OSError, SyntaxError, ValueError):
            return  # imported as usual (and fails as usual)
        self.codes[path] = (st.st_mtime_ns, st.st_size, code)

    def find_spec(self, fullname: str, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname != self.package and not fullname.startswith(self.package + "."):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is None:
                continue
            if (type(spec.loader) is importlib.machinery.SourceFileLoader
                    and spec.origin in self.codes):
                spec.loader = _CachedSourceLoader(fullname, spec.origin, self.codes)
            return spec
        return None

    def invalidate_caches(self) -> None:
        """Nothing is cached but the code, which is checked against the file at each load."""


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
    if os.environ.get(START_PRIORITY_VAR) == "idle":
        if may_raise_priority():
            with contextlib.suppress(OSError):  # forbidden (a sandbox): starts as before
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        if set_session_group_nice(19, wait_s=0.3):  # the group, or SCHED_IDLE weighs nothing
            os.environ[START_GROUP_VAR] = "nice 19"
    if os.environ.get(MEMORY_HOLDER_VAR) == "1":  # before the worker opens its sockets
        start_memory_holder()
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
    for name in OPTIONAL_PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(name)
    # A dead worker's orphans (its memory holder) become this process's, reaped here.
    _holder.set_child_subreaper()
    # A child's death wakes the loop at once: a dead worker's holder is killed then, and
    # its memory (and the memory reserve's lock its mapping holds) goes without waiting.
    woken, wake = socket.socketpair()
    for end in (woken, wake):
        end.setblocking(False)
    signal.set_wakeup_fd(wake.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    compiled = CompiledSources(COMPILED_PACKAGE)
    sys.meta_path.insert(0, compiled)
    gc.freeze()  # the imported objects stay out of the children's collections (and pages)
    server.listen(64)  # launchers that connected before now were refused, and retry
    print(f"planaria fork server {os.getpid()}: {', '.join(PRELOAD)} and {len(compiled.codes)} "
          f"{COMPILED_PACKAGE} modules compiled in {time.time() - t0:.2f} s", flush=True)
    # worker pid -> its launcher's connection (None once the launcher is gone)
    children: dict[int, socket.socket | None] = {}
    while _alive(raylet_pid):
        watched = [c for c in children.values() if c is not None]
        readable, _, _ = select.select([server, woken, *watched], [], [], 0.5)
        for conn in readable:
            if conn is woken:
                with contextlib.suppress(BlockingIOError):
                    woken.recv(4096)
            elif conn is server:
                _accept(server, children, (woken, wake))
            else:  # a launcher's connection closed: the process Ray knows is gone
                pid = next(p for p, c in children.items() if c is conn)
                conn.close()
                children[pid] = None  # reaped later, with no one to tell
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        _reap(children)


def _accept(server: socket.socket, children: dict[int, socket.socket | None],
            wakeup: tuple[socket.socket, socket.socket]) -> None:
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
        signal.set_wakeup_fd(-1)  # the server's, not the worker's
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for end in wakeup:
            end.close()
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
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid not in children:  # an orphan of a worker's (its memory holder)
            continue
        kill_group(pid)
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


if __name__ == "__main__":
    # Run as a file: its own directory (planaria's modules) must not shadow top-level names.
    sys.path.pop(0)
    serve("\0" + sys.argv[1], int(sys.argv[2]))
