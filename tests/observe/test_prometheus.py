"""The Prometheus exporter, scraped over loopback after feeding it events."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from planaria.observe.prometheus import MetricsExporter


def _ev(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "event": event, **fields}


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_exporter_serves_metrics_after_events() -> None:
    exporter = MetricsExporter(0, job="tiny")
    try:
        assert exporter.port
        feed = [_ev(0.0, "run_start", replicas=3, steps=10, run_id="r1"),
                _ev(1.0, "generation", gen=0, world_size=3)]
        feed += [_ev(2.0 + i, "step_committed", step=i, width=3, duration_s=1.0, samples=12,
                     samples_per_s=12.0, data_wait_s=0.0, loss=2.0 - i, lr=0.1,
                     grad_norm=1.5) for i in range(3)]
        feed += [_ev(5.1, "fault", fault_id="f1", kind="worker_lost", worker="w2", fault_t=5.0),
                 _ev(5.1, "detected", fault_id="f1", detect_s=0.1),
                 _ev(5.2, "generation", gen=1, world_size=2),
                 _ev(6.0, "step_committed", step=3, width=2, duration_s=0.5, samples=12,
                     samples_per_s=24.0, data_wait_s=0.0, loss=0.5, lr=0.05, grad_norm=0.25),
                 _ev(6.0, "recovered", fault_id="f1", step=3, recover_s=1.0, lost_steps=0),
                 _ev(6.5, "checkpoint_saved", step=3, stall_s=0.02, save_s=0.2),
                 _ev(7.0, "checkpoint_failed", step=4, error="disk full", reason="interval"),
                 _ev(7.5, "eval", step=4, metrics={"loss": 0.75, "acc": 0.5}, samples=8)]
        for rec in feed:
            exporter(rec)
        m = _scrape(exporter.port)
        run = (("job", "tiny"), ("run_id", "r1"))  # on every series
        assert all(dict(labels).get("run_id") == "r1" and dict(labels).get("job") == "tiny"
                   for (_, labels) in m)
        assert m[("planaria_steps_committed_total", run)] == 4
        assert m[("planaria_step_duration_seconds_count", run)] == 4
        assert m[("planaria_step_duration_seconds_sum", run)] == pytest.approx(3.5)
        assert m[("planaria_live_replicas", run)] == 2
        assert m[("planaria_target_replicas", run)] == 3
        assert m[("planaria_faults_total", (*run[:1], ("kind", "worker_lost"), *run[1:]))] == 1
        assert m[("planaria_recover_seconds_count", run)] == 1
        assert m[("planaria_recover_seconds_sum", run)] == pytest.approx(1.0)
        assert m[("planaria_checkpoint_stall_seconds_sum", run)] == pytest.approx(0.02)
        assert m[("planaria_samples_per_second", run)] == 24.0
        assert m[("planaria_goodput_ratio", run)] == pytest.approx(3.5 / 7.5)
        assert m[("planaria_loss", run)] == 0.5
        assert m[("planaria_learning_rate", run)] == 0.05
        assert m[("planaria_grad_norm", run)] == 0.25
        assert m[("planaria_checkpoint_saves_total", run)] == 1
        assert m[("planaria_checkpoint_failures_total", run)] == 1
        assert m[("planaria_checkpoint_save_seconds_count", run)] == 1
        assert m[("planaria_checkpoint_save_seconds_sum", run)] == pytest.approx(0.2)
        assert m[("planaria_eval_metric", (run[0], ("metric", "acc"), run[1]))] == 0.5
    finally:
        exporter.close()
    exporter.close()  # idempotent


def test_own_registry_and_no_server() -> None:
    a, b = MetricsExporter(None), MetricsExporter(None)  # no clash between registries
    assert a.port is None and a.registry is not b.registry
    a(_ev(0.0, "step_committed", step=0, duration_s=1.0))
    labels = {"run_id": "", "job": ""}  # before a run_start names the run
    assert a.registry.get_sample_value("planaria_steps_committed_total", labels) == 1
    assert b.registry.get_sample_value("planaria_steps_committed_total", labels) is None


def test_exporter_binds_the_host_it_is_given() -> None:
    with MetricsExporter(0, addr="127.0.0.2") as exporter:
        assert exporter.port
        exporter(_ev(0.0, "run_start", replicas=1, run_id="r2"))
        with urllib.request.urlopen(f"http://127.0.0.2:{exporter.port}/metrics",
                                    timeout=5) as resp:
            assert 'run_id="r2"' in resp.read().decode()
        with pytest.raises(OSError):  # not on the other loopback address
            urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=5)
