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
    exporter = MetricsExporter(0)
    try:
        assert exporter.port
        feed = [_ev(0.0, "run_start", replicas=3, steps=10),
                _ev(1.0, "generation", gen=0, world_size=3)]
        feed += [_ev(2.0 + i, "step_committed", step=i, width=3, duration_s=1.0, samples=12,
                     samples_per_s=12.0, data_wait_s=0.0) for i in range(3)]
        feed += [_ev(5.1, "fault", fault_id="f1", kind="worker_lost", worker="w2", fault_t=5.0),
                 _ev(5.1, "detected", fault_id="f1", detect_s=0.1),
                 _ev(5.2, "generation", gen=1, world_size=2),
                 _ev(6.0, "step_committed", step=3, width=2, duration_s=0.5, samples=12,
                     samples_per_s=24.0, data_wait_s=0.0),
                 _ev(6.0, "recovered", fault_id="f1", step=3, recover_s=1.0, lost_steps=0),
                 _ev(6.5, "checkpoint_saved", step=3, stall_s=0.02, save_s=0.2)]
        for rec in feed:
            exporter(rec)
        m = _scrape(exporter.port)
        assert m[("planaria_steps_committed_total", ())] == 4
        assert m[("planaria_step_duration_seconds_count", ())] == 4
        assert m[("planaria_step_duration_seconds_sum", ())] == pytest.approx(3.5)
        assert m[("planaria_live_replicas", ())] == 2
        assert m[("planaria_target_replicas", ())] == 3
        assert m[("planaria_faults_total", (("kind", "worker_lost"),))] == 1
        assert m[("planaria_recover_seconds_count", ())] == 1
        assert m[("planaria_recover_seconds_sum", ())] == pytest.approx(1.0)
        assert m[("planaria_checkpoint_stall_seconds_sum", ())] == pytest.approx(0.02)
        assert m[("planaria_samples_per_second", ())] == 24.0
        assert m[("planaria_goodput_ratio", ())] == pytest.approx(3.5 / 6.5)
    finally:
        exporter.close()
    exporter.close()  # idempotent


def test_own_registry_and_no_server() -> None:
    a, b = MetricsExporter(None), MetricsExporter(None)  # no clash between registries
    assert a.port is None and a.registry is not b.registry
    a(_ev(0.0, "step_committed", step=0, duration_s=1.0))
    assert a.registry.get_sample_value("planaria_steps_committed_total") == 1
    assert b.registry.get_sample_value("planaria_steps_committed_total") == 0
