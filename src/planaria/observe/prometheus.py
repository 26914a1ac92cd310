"""Opt-in Prometheus exporter: an event listener that serves the run's metrics over HTTP.

Names follow Prometheus conventions (base units, ``_total`` counters,
``_seconds`` durations, ``_ratio`` fractions). The exporter has its own
``CollectorRegistry`` unless one is given, and binds to 127.0.0.1 by default. Every
series carries a ``run_id`` label (the run's id, from its ``run_start``) and a ``job`` label
(the spec's name), so runs that share a Prometheus stay apart.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from planaria.observe.goodput import GoodputTracker
from planaria.observe.rank_times import record_ranks
from planaria.observe.segments import num

__all__ = ["MetricsExporter"]

_RECOVER_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_SAVE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_STALL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class MetricsExporter:
    """Serves ``/metrics`` on ``addr:port`` (port 0 picks a free one; see ``.port``).

    ``port=None`` starts no server (the registry can still be read or pushed). ``job``: the
    ``job`` label (the spec's name); ``run_id``: the ``run_id`` label until a ``run_start``
    record names the run. Register with ``EventLog.add_listener(exporter)``; ``close()``
    stops the server.
    """

    def __init__(
        self, port: int | None = 0, registry: CollectorRegistry | None = None, *,
        addr: str = "127.0.0.1", job: str = "", run_id: str = "",
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.labels = {"run_id": run_id, "job": job}
        """The labels of every series (``run_id`` changes with a ``run_start`` record)."""
        r, names = self.registry, ("run_id", "job")

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=r)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, [*names, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | None = None
                      ) -> Histogram:
            if buckets is None:
                return Histogram(name, doc, names, registry=r)
            return Histogram(name, doc, names, buckets=buckets, registry=r)

        self.steps = counter("planaria_steps_committed", "Steps committed.")
        self.failed = counter("planaria_steps_failed", "Steps that did not commit.")
        self.step_duration = histogram("planaria_step_duration_seconds",
                                       "Duration of committed steps.")
        self.last_step = gauge("planaria_last_committed_step", "Latest committed step.")
        self.live = gauge("planaria_live_replicas", "Replicas in the current generation.")
        self.target = gauge("planaria_target_replicas", "Replicas the run asked for.")
        self.loss = gauge("planaria_loss", "Loss of the latest committed step.")
        self.lr = gauge("planaria_learning_rate", "Learning rate of the latest committed step.")
        self.grad_norm = gauge("planaria_grad_norm",
                               "Reduced gradient norm of the latest committed step.")
        self.eval_metric = gauge("planaria_eval_metric", "The latest evaluation's figures.",
                                 ("metric",))
        self.faults = counter("planaria_faults", "Faults by kind.", ("kind",))
        self.detect = histogram("planaria_detect_seconds", "Fault to detection.",
                                _RECOVER_BUCKETS)
        self.recover = histogram("planaria_recover_seconds",
                                 "Fault to first committed step after it.", _RECOVER_BUCKETS)
        self.lost_steps = counter("planaria_lost_steps", "Committed steps computed again.")
        self.saves = counter("planaria_checkpoint_saves", "Checkpoints committed.")
        self.save_failures = counter("planaria_checkpoint_failures",
                                     "Checkpoint saves that did not commit.")
        self.save_duration = histogram("planaria_checkpoint_save_seconds",
                                       "Snapshot to commit of each committed checkpoint.",
                                       _SAVE_BUCKETS)
        self.stall = histogram("planaria_checkpoint_stall_seconds",
                               "Training stall per committed checkpoint.", _STALL_BUCKETS)
        self.restore = histogram("planaria_restore_seconds", "Checkpoint read and load time.",
                                 _RECOVER_BUCKETS)
        self.goodput = gauge("planaria_goodput_ratio",
                             "Kept step time over wall time since the run started.")
        self.samples_per_s = gauge("planaria_samples_per_second",
                                   "Samples per second of the latest committed step.")
        self.rank_time = gauge("planaria_rank_step_seconds",
                               "Each rank's time in each part of the latest committed step "
                               "that carried it (load, compute, reduce_wait, apply).",
                               ("rank", "part"))
        self._tracker = GoodputTracker()
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        if port is not None:
            self._server, self._thread = start_http_server(port, addr=addr, registry=r)
            self.port = int(self._server.server_address[1])

    def _set(self, gauge: Gauge, value: Any, **extra: str) -> None:
        if (v := num(value)) is not None:
            gauge.labels(**self.labels, **extra).set(v)

    def _observe(self, metric: Histogram, value: Any) -> None:
        if (v := num(value)) is not None:
            metric.labels(**self.labels).observe(v)

    def __call__(self, record: dict[str, Any]) -> None:
        ev = record["event"]
        if ev == "run_start" and record.get("run_id"):
            self.labels = {**self.labels, "run_id": str(record["run_id"])}
        with self._lock:
            self.goodput.labels(**self.labels).set(self._tracker.observe(record))
        if ev == "run_start":
            self._set(self.target, record.get("replicas"))
        elif ev == "step_committed":
            self.steps.labels(**self.labels).inc()
            self.last_step.labels(**self.labels).set(num(record.get("step")) or 0)
            self._observe(self.step_duration, record.get("duration_s"))
            self._set(self.live, record.get("width"))
            self._set(self.samples_per_s, record.get("samples_per_s"))
            self._set(self.loss, record.get("loss"))
            self._set(self.lr, record.get("lr"))
            self._set(self.grad_norm, record.get("grad_norm"))
            for rank, parts in record_ranks(record):
                for part, value in parts.items():
                    self._set(self.rank_time, value, rank=str(rank), part=part)
        elif ev == "eval":
            for name, value in (record.get("metrics") or {}).items():
                self._set(self.eval_metric, value, metric=str(name))
        elif ev == "generation":
            self._set(self.live, record.get("world_size"))
        elif ev == "step_failed":
            self.failed.labels(**self.labels).inc()
        elif ev == "fault":
            self.faults.labels(**self.labels, kind=str(record.get("kind"))).inc()
        elif ev == "detected":
            self._observe(self.detect, record.get("detect_s"))
        elif ev == "recovered":
            self._observe(self.recover, record.get("recover_s"))
            self.lost_steps.labels(**self.labels).inc(max(num(record.get("lost_steps")) or 0, 0))
        elif ev == "checkpoint_saved":
            self.saves.labels(**self.labels).inc()
            self._observe(self.stall, record.get("stall_s"))
            self._observe(self.save_duration, record.get("save_s"))
        elif ev == "checkpoint_failed":
            self.save_failures.labels(**self.labels).inc()
        elif ev == "restore":
            self._observe(self.restore, record.get("restore_s"))
        elif ev == "run_end":
            self.live.labels(**self.labels).set(0)

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
