"""Ray's own processes, watched: a job whose GCS or raylet died ends cleanly, and says so.

What happens without this watch (measured on this machine, Ray 2.60, a local Ray
session the job started, workers of 0.07 s steps):

- **The GCS killed.** Nothing fails at first: actor calls go straight to the
  workers, so training and checkpoints go on (820 more steps, 80 saves). Calls that
  need the GCS block (``ray.nodes()``, the internal KV with no timeout) or never
  finish (a new actor stays pending); ``ray.kill`` returns and kills nothing. 60 s
  after the loss (``RAY_gcs_rpc_server_reconnect_timeout_s``, default 60; 15 gives
  15) Ray's C++ ends the controller (exit 1, "Failed to connect to GCS within 60
  seconds"): no save of the last steps, no ``run_end``, a save's partial directory
  left. The raylet and the workers go with it; Ray's agents live 60 s longer.
- **The raylet killed.** The workers live on for ~14 s (they train), then die; the
  job takes it as every replica lost, waits ``pause_timeout_s`` (120 s) for
  replacements that cannot come (no node), and aborts blaming the cluster's
  capacity. A call whose result goes through the object store kills the worker that
  answers it, and a ``ray.put`` the controller (exit 1, no message).

So the controller watches (:class:`RayWatch`, a thread): in a Ray session the job
started itself, the ``gcs_server`` and ``raylet`` processes by pid (a death is
certain, and no GCS comes back: it kept its state in memory); on a cluster, the
raylet of the controller's node by pid where it runs here, and the GCS by asking
it (a probe every :data:`GCS_PROBE_S`) -- lost once it has not answered for most of
Ray's own reconnect timeout (a GCS with fault tolerance may come back within it).
Once something died, the run in progress ends at its next step (the stop key
lives in planaria's own store, not Ray's), the job saves the step in hand where
every member holds it (direct actor calls work without the GCS; every result is
small), and ends with :class:`~planaria.faults.errors.RayLost` naming what died. The
close then kills what is left (see :mod:`planaria.control.reaper`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planaria.control import _reaper
from planaria.faults.errors import RayLost

if TYPE_CHECKING:
    from collections.abc import Sequence

    from planaria.control.pool import WorkerHandle
    from planaria.control.protocols import Checkpoints
    from planaria.observe.events import EventLog

__all__ = ["RayWatch", "gcs_grace_s"]

_log = logging.getLogger("planaria.membership")

WATCH_S = 0.25
"""How often the watched processes are checked."""
GCS_PROBE_S = 1.0
"""How often a cluster's GCS is asked whether it is there (one small RPC)."""
GCS_PROBE_TIMEOUT_S = 2.0
"""How long one such question waits for its answer."""
RECONNECT_VAR = "RAY_gcs_rpc_server_reconnect_timeout_s"
RECONNECT_DEFAULT_S = 60.0
END_MARGIN_S = 20.0
"""Time kept to save and end before Ray's C++ would end the controller."""


def gcs_grace_s() -> float:
    """How long a cluster's GCS may not answer before the job ends: most of Ray's own
    reconnect timeout (after which Ray ends the controller), leaving
    :data:`END_MARGIN_S` (at least half of it) to save and end."""
    try:
        reconnect = float(os.environ.get(RECONNECT_VAR, RECONNECT_DEFAULT_S))
    except ValueError:
        reconnect = RECONNECT_DEFAULT_S
    return max(reconnect / 2, reconnect - END_MARGIN_S)


@dataclass(frozen=True)
class _Process:
    name: str  # "gcs_server", "raylet"
    pid: int
    start: int  # its start time (clock ticks since boot): a reused pid is not it


class RayWatch:
    """Watches Ray's GCS and raylet for a job (see the module doc).

    ``owned``: the job started this Ray session itself. :attr:`lost` is None until one
    of them died, then the :class:`~planaria.faults.errors.RayLost` to end the job with.
    """

    def __init__(self, log: EventLog, *, owned: bool) -> None:
        self.log = log
        self.owned = owned
        self.lost: RayLost | None = None
        self._ended: RayLost | None = None  # the error the job ended with (see end)
        self._processes: list[_Process] = []
        self._probe: Any = None  # the cluster's GCS client, when asked rather than watched
        self._unanswered_since: float | None = None
        self._grace_s = gcs_grace_s()
        self._stop = threading.Event()
        try:
            self._find()
        except Exception:  # a Ray without these internals: nothing is watched
            _log.warning("cannot watch Ray's GCS and raylet: their death will end the job "
                         "only through Ray's own timeouts", exc_info=True)
        self._thread = threading.Thread(target=self._loop, name="planaria-ray-watch",
                                        daemon=True)
        if self._processes or self._probe is not None:
            self._thread.start()

    @property
    def watched(self) -> dict[str, int | None]:
        """What is watched: process name -> pid (None: asked over the network)."""
        out: dict[str, int | None] = {p.name: p.pid for p in self._processes}
        if self._probe is not None:
            out["gcs_server"] = None
        return out

    def stop(self) -> None:
        self._stop.set()

    # ---- finding and watching ----------------------------------------------------------------

    def _find(self) -> None:
        import ray

        node = ray._private.worker._global_node
        if node is None:  # Ray Client: nothing of Ray's runs here
            return
        if self.owned:
            for name in ("gcs_server", "raylet"):
                for info in node.all_processes.get(name, ()):
                    self._add(name, info.process.pid)
            return
        raylet = _raylet_pid(node.raylet_socket_name)
        if raylet is not None:
            self._add("raylet", raylet)
        self._probe = ray._private.worker.global_worker.gcs_client

    def _add(self, name: str, pid: int) -> None:
        start = _reaper.start_time(pid)
        if start is not None:
            self._processes.append(_Process(name, pid, start))

    def _loop(self) -> None:
        next_probe = time.monotonic()
        while not self._stop.wait(WATCH_S):
            for proc in self._processes:
                if _reaper.start_time(proc.pid) != proc.start:
                    self._died(proc.name, proc.pid, how="its process exited", since=None)
                    return
            if self._probe is not None and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + GCS_PROBE_S
                if self._gcs_gone():
                    return

    def _gcs_gone(self) -> bool:
        """Asks the cluster's GCS; True once it has not answered for the grace period."""
        asked = time.time()
        try:
            self._probe.internal_kv_get(b"planaria-probe", b"planaria",
                                        timeout=GCS_PROBE_TIMEOUT_S)
        except Exception as err:
            if self._unanswered_since is None:
                self._unanswered_since = asked
                _log.warning("Ray's GCS does not answer (%s); the job ends if it does not "
                             "within %.0f s", err, self._grace_s)
            if time.time() - self._unanswered_since >= self._grace_s:
                self._died("gcs_server", None, since=self._unanswered_since,
                           how=f"it did not answer for {time.time() - self._unanswered_since:.0f}"
                               f" s ({type(err).__name__}: {err})")
                return True
            return False
        if self._unanswered_since is not None:
            _log.warning("Ray's GCS answers again after %.1f s", asked - self._unanswered_since)
        self._unanswered_since = None
        return False

    def _died(self, name: str, pid: int | None, *, how: str, since: float | None) -> None:
        now = time.time()
        what = {"gcs_server": "Ray's GCS", "raylet": "the raylet of this node"}[name]
        where = f"{name}, pid {pid}" if pid is not None else name
        self.lost = RayLost(
            f"{what} ({where}) died: {how}. The job cannot go on without it",
            process=name, pid=pid,
        )
        self.log.emit("ray_lost", process=name, pid=pid, owned=self.owned, how=how,
                      since_t=since if since is not None else now)
        _log.error("%s (%s) died: %s", what, where, how)

    # ---- ending the job ----------------------------------------------------------------------

    def end(self, checkpoints: Checkpoints | None, members: Sequence[WorkerHandle], *,
            save: bool, cause: BaseException | None = None) -> RayLost:
        """The error to end the job with, once :attr:`lost` is set. With ``save`` (the job
        is at a step boundary: every member holds the committed state) the step in hand
        is saved first (by ``checkpoints``, None when they are off, where ``members`` all
        hold it); the outcome goes into the error's message. ``cause``: a failure
        that followed the loss (nothing is saved then). Once only: a second call returns
        the same error."""
        if self._ended is not None:
            return self._ended
        lost = self.lost
        assert lost is not None
        if save:
            saved, outcome = _save(checkpoints, members)
        else:
            kind = getattr(cause, "kind", None)
            why = (f"{kind} followed it" if kind is not None
                   else "the job was not at a step boundary")
            saved, outcome = None, _no_save(checkpoints, why)
        self._ended = RayLost(f"{lost}; {outcome}", process=lost.process, pid=lost.pid,
                              saved=saved)
        self.log.emit("action", fault_id=None, action="abort", reason=str(self._ended))
        return self._ended


def _save(ck: Checkpoints | None, members: Sequence[WorkerHandle]) -> tuple[str | None, str]:
    """Saves the step in hand where it is safe; returns (path, what happened)."""
    if ck is None:
        return None, "checkpointing is off: nothing was saved"
    if not members or not all(h.has_state for h in members):
        return None, _no_save(ck, "no member holds the committed state")
    try:
        path = ck.save_now(reason="ray_lost")
    except Exception as err:  # the workers went with Ray's process, or the storage failed
        return None, _no_save(ck, f"the save failed ({type(err).__name__}: {err})")
    if path is None:
        return None, _no_save(ck, "the save did not commit")
    return path, f"step {ck.last_committed} was saved ({path})"


def _no_save(ck: Checkpoints | None, why: str) -> str:
    if ck is None:
        return f"nothing was saved ({why}; checkpointing is off)"
    newest = ck.last_committed
    stands = (f"the newest committed checkpoint, step {newest}, stands" if newest is not None
              and newest >= 0 else "no checkpoint was committed")
    return f"nothing was saved ({why}): {stands}"


def _raylet_pid(socket_name: str) -> int | None:
    """The pid of the raylet on this machine that listens on ``socket_name``, if any."""
    needle = f"--raylet_socket_name={socket_name}".encode()
    if not os.path.isdir("/proc"):  # not Linux: its death is seen through its workers'
        return None
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"raylet") and needle in argv:
            return int(name)
    return None
