"""Drain notices from outside the worker: Ray's draining nodes and a node's SIGTERM.

A worker that gets SIGTERM drains at the next step boundary (see
``Vitals.notice_preemption``). Two other ways a planned departure is announced:

- **Ray drains a node** (the autoscaler scaling down, KubeRay deleting a pod,
  ``ray drain-node``, a ``ray start`` that got SIGTERM): :class:`NodeDrainWatch`
  polls the GCS for draining nodes in a background thread, and the controller
  drains the workers on those nodes at the next boundary, as if each had got
  SIGTERM.
- **The node's first process gets SIGTERM** (a Kubernetes pod being deleted: the
  kubelet signals the container's PID 1, the ``ray start`` entrypoint, not the
  worker processes): :func:`node_drain_hook` (``planaria node-drain-hook``), run
  as the pod's preStop hook or as a wrapper around ``ray start``, marks the node
  draining in Ray (so no replacement is scheduled there), forwards SIGTERM to the
  planaria workers on the node and waits until they have left, then lets the
  node stop.

Workers find each other on a node through **markers**
(:mod:`planaria.wire.worker_markers`): each worker writes a file named after its pid in
:func:`~planaria.wire.worker_markers.worker_dir` (``$PLANARIA_WORKER_DIR``, default
``<tmp>/planaria-workers``) holding its process start time (to tell a reused pid
apart), name, Ray node id and GCS address.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planaria.faults.errors import ConfigError
from planaria.wire.worker_markers import WorkerMarker, live_workers

__all__ = ["NodeDrainWatch", "node_drain_hook"]

_log = logging.getLogger("planaria.membership")

# ---- Ray's draining nodes --------------------------------------------------------------------


def draining_nodes() -> dict[str, int]:
    """Ray's draining nodes, ``{node_id_hex: deadline_ms}`` (0: no deadline), from the GCS.

    Needs a connected driver (``ray.init``). The same query Ray Train's preemption
    watcher and Ray Serve use; Ray has no public API for it yet.
    """
    import ray

    return dict(ray._private.state.state.get_draining_nodes())


class NodeDrainWatch:
    """Polls Ray for draining nodes every ``interval_s`` in a daemon thread.

    The step path never waits on it: :meth:`draining` returns the last answer.
    A query that fails is logged (once until one succeeds again) and retried at
    the next poll.
    """

    def __init__(
        self, interval_s: float, *, query: Callable[[], dict[str, int]] = draining_nodes
    ) -> None:
        if not interval_s > 0:
            raise ConfigError(
                f"drain_poll_s={interval_s!r} is not valid: a number of seconds > 0, or None "
                "to not watch Ray for draining nodes"
            )
        self.interval_s = interval_s
        self._query = query
        self._lock = threading.Lock()
        self._nodes: dict[str, int] = {}
        self._failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="planaria-drain-watch",
                                        daemon=True)
        self._thread.start()

    def draining(self) -> dict[str, int]:
        with self._lock:
            return dict(self._nodes)

    def poll_now(self) -> dict[str, int]:
        """Queries now (in the caller's thread) and returns the answer."""
        self._poll()
        return self.draining()

    def _poll(self) -> None:
        try:
            nodes = self._query()
        except Exception as err:
            if not self._failing:
                _log.warning("could not ask Ray for draining nodes (retrying every %.1f s): %r",
                             self.interval_s, err)
            self._failing = True
            return
        self._failing = False
        with self._lock:
            self._nodes = nodes

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._poll()

    def stop(self, *, wait_s: float = 5.0) -> None:
        """Stops the polls; waits up to ``wait_s`` for one in progress (0: a query that
        cannot end, its GCS gone, is left to its daemon thread)."""
        self._stop.set()
        self._thread.join(timeout=wait_s)


# ---- the node hook ---------------------------------------------------------------------------


def _mark_draining(markers: list[WorkerMarker], deadline_s: float) -> list[str]:
    """Asks Ray's GCS to drain the workers' nodes (reason: preemption, which the GCS never
    rejects), so that no replacement is scheduled there. Returns the nodes marked."""
    nodes = sorted({(m.node_id, m.gcs_address) for m in markers
                    if m.node_id is not None and m.gcs_address is not None})
    if not nodes:
        return []
    import ray._raylet
    from ray.core.generated import autoscaler_pb2 as pb

    raylet: Any = ray._raylet
    messages: Any = pb  # generated protobuf code: no stubs
    reason = messages.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    deadline_ms = int((time.time() + deadline_s) * 1000)
    marked = []
    for node_id, address in nodes:
        try:
            accepted, why = raylet.GcsClient(address=address).drain_node(
                node_id, reason, "planaria node-drain-hook: the node got SIGTERM", deadline_ms
            )
        except Exception as err:  # the workers still get SIGTERM: the drain goes on
            _log.warning("could not mark node %s draining in Ray: %r", node_id, err)
            continue
        if accepted:
            marked.append(node_id)
        else:
            _log.warning("Ray refused to drain node %s: %s", node_id, why)
    return marked


def notify_workers(
    *, folder: Path | None = None, grace_s: float, ray_drain: bool = True,
    say: Callable[[str], None] = print,
) -> list[WorkerMarker]:
    """Gives the planaria workers on this machine their notice and waits (at most
    ``grace_s``) until they have left; returns those still alive then."""
    markers = live_workers(folder)
    if not markers:
        say("planaria node-drain-hook: no planaria worker on this node")
        return []
    for m in markers:  # first: the notice never waits on Ray
        with contextlib.suppress(ProcessLookupError):
            os.kill(m.pid, signal.SIGTERM)
    say("planaria node-drain-hook: SIGTERM sent to "
        + ", ".join(f"{m.name} (pid {m.pid})" for m in markers))
    if ray_drain:  # well before the drained workers' replacements are asked for
        marked = _mark_draining(markers, grace_s)
        if marked:
            say(f"planaria node-drain-hook: Ray node {', '.join(marked)} marked draining")
    end = time.monotonic() + grace_s
    left = markers
    while left and time.monotonic() < end:
        time.sleep(0.2)
        left = [m for m in left if m.alive()]
    if left:
        say(f"planaria node-drain-hook: {', '.join(m.name for m in left)} still running after "
            f"{grace_s:g} s")
    else:
        say("planaria node-drain-hook: every planaria worker on this node has left")
    return left


def node_drain_hook(
    command: list[str], *, grace_s: float, folder: Path | None = None, ray_drain: bool = True,
) -> int:
    """``planaria node-drain-hook``. Without ``command``, a preStop hook: the notice now.

    With ``command`` (``ray start ... --block``), an entrypoint: runs it, and on
    SIGTERM (or SIGINT) gives the workers their notice, waits for them to leave,
    then forwards the signal to ``command`` and returns its exit status.
    """
    if not grace_s > 0:
        raise ConfigError(
            f"--grace-s={grace_s!r} is not valid: the seconds to wait for the workers to leave, "
            "> 0 and below the pod's terminationGracePeriodSeconds"
        )
    if not command:
        left = notify_workers(folder=folder, grace_s=grace_s, ray_drain=ray_drain)
        return 1 if left else 0
    try:
        child = subprocess.Popen(command)
    except OSError as err:
        raise ConfigError(
            f"cannot run {command[0]!r}: {err.strerror}; give the node's command after --, e.g. "
            "planaria node-drain-hook -- ray start --address=HEAD:6379 --block"
        ) from None
    got: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        got.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while True:
        try:
            code = child.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        if got:
            notify_workers(folder=folder, grace_s=grace_s, ray_drain=ray_drain)
            child.send_signal(got[0])
            code = child.wait()
            break
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says
