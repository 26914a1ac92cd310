"""Opt-in Prometheus exporter: an event listener that serves the run's metrics over HTTP.

Names follow Prometheus conventions (base units, ``_total`` counters,
``_seconds`` durations, ``_ratio`` fractions). The exporter has its own
``CollectorRegistry`` unless one is given, and binds to 127.0.0.1 by default.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from planaria.observe.goodput import GoodputTracker
from planaria.observe.segments import num

__all__ = ["MetricsExporter"]

_RECOVER_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_STALL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class MetricsExporter:
    """Serves ``/metrics`` on ``addr:port`` (port 0 picks a free one; see ``.port``).

    ``port=None`` starts no server (the registry can still be read or pushed).
    Register with ``EventLog.add_listener(exporter)``; ``close()`` stops the server.
    """

    def __init__(
        self, port: int | None = 0, registry: CollectorRegistry | None = None, *,
        addr: str = "127.0.0.1",
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.steps = Counter("planaria_steps_committed", "Steps committed.", registry=r)
        self.failed = Counter("planaria_steps_failed", "Steps that did not commit.", registry=r)
        self.step_duration = Histogram("planaria_step_duration_seconds",
                                       "Duration of committed steps.", registry=r)
        self.last_step = Gauge("planaria_last_committed_step", "Latest committed step.",
                               registry=r)
        self.live = Gauge("planaria_live_replicas", "Replicas in the current generation.",
                          registry=r)
        self.target = Gauge("planaria_target_replicas", "Replicas the run asked for.", registry=r)
        self.faults = Counter("planaria_faults", "Faults by kind.", ["kind"], registry=r)
        self.detect = Histogram("planaria_detect_seconds", "Fault to detection.",
                                buckets=_RECOVER_BUCKETS, registry=r)
        self.recover = Histogram("planaria_recover_seconds",
                                 "Fault to first committed step after it.",
                                 buckets=_RECOVER_BUCKETS, registry=r)
        self.lost_steps = Counter("planaria_lost_steps", "Committed steps computed again.",
                                  registry=r)
        self.stall = Histogram("planaria_checkpoint_stall_seconds",
                               "Training stall per committed checkpoint.",
                               buckets=_STALL_BUCKETS, registry=r)
        self.restore = Histogram("planaria_restore_seconds", "Checkpoint read and load time.",
                                 buckets=_RECOVER_BUCKETS, registry=r)
        self.goodput = Gauge("planaria_goodput_ratio",
                             "Kept step time over wall time since the run started.", registry=r)
        self.samples_per_s = Gauge("planaria_samples_per_second",
                                   "Samples per second of the latest committed step.", registry=r)
        self._tracker = GoodputTracker()
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        if port is not None:
            self._server, self._thread = start_http_server(port, addr=addr, registry=r)
            self.port = int(self._server.server_address[1])

    def __call__(self, record: dict[str, Any]) -> None:
        ev = record["event"]
        with self._lock:
            self.goodput.set(self._tracker.observe(record))
        if ev == "run_start" and num(record.get("replicas")) is not None:
            self.target.set(num(record.get("replicas")) or 0)
        elif ev == "step_committed":
            self.steps.inc()
            self.last_step.set(num(record.get("step")) or 0)
            if (dur := num(record.get("duration_s"))) is not None:
                self.step_duration.observe(dur)
            if (width := num(record.get("width"))) is not None:
                self.live.set(width)
            if (sps := num(record.get("samples_per_s"))) is not None:
                self.samples_per_s.set(sps)
        elif ev == "generation" and (size := num(record.get("world_size"))) is not None:
            self.live.set(size)
        elif ev == "step_failed":
            self.failed.inc()
        elif ev == "fault":
            self.faults.labels(kind=str(record.get("kind"))).inc()
        elif ev == "detected" and (d := num(record.get("detect_s"))) is not None:
            self.detect.observe(d)
        elif ev == "recovered":
            if (rs := num(record.get("recover_s"))) is not None:
                self.recover.observe(rs)
            self.lost_steps.inc(max(num(record.get("lost_steps")) or 0, 0))
        elif ev == "checkpoint_saved" and (st := num(record.get("stall_s"))) is not None:
            self.stall.observe(st)
        elif ev == "restore" and (rt := num(record.get("restore_s"))) is not None:
            self.restore.observe(rt)
        elif ev == "run_end":
            self.live.set(0)

    def close(self) -> None:
        """Stops the HTTP server (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def __enter__(self) -> MetricsExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
