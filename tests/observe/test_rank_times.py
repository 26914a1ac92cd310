"""Where each rank's step time went, read from the ``ranks`` of ``step_committed`` records:
the per-rank summary (the slowest rank named), the report's table, JSON and picture, the
Prometheus gauges and the trackers' scalars (bounded for wide jobs). Logs without ``ranks``
(written before they were recorded) still read."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from planaria.observe.metrics import summarize
from planaria.observe.prometheus import MetricsExporter
from planaria.observe.rank_times import rank_scalars, summarize_ranks
from planaria.observe.report import plot_timeline, render_summary, report_main
from planaria.observe.trackers.base import StepScalars, tracker_entry


def _ev(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "event": event, **fields}


def _commit(step: int, ranks: dict[str, Any] | None, width: int = 3) -> dict[str, Any]:
    extra = {} if ranks is None else {"ranks": ranks}
    return _ev(1.0 + step, "step_committed", step=step, gen=0, width=width, duration_s=0.9,
               loss=1.0, samples=12, samples_per_s=12 / 0.9, data_wait_s=0.01, metrics={},
               **extra)


def _slow_rank_2(step: int, last: bool = False) -> dict[str, Any]:
    """Rank 2 loads 0.3 s a step; ranks 0 and 1 wait for it (a run's last step: not known)."""
    return {"load": [0.01, 0.01, 0.3], "compute": [0.1, 0.11, 0.1],
            "reduce_wait": [None] * 3 if last else [0.3, 0.29, 0.01],
            "apply": [None] * 3 if last else [0.02, 0.02, 0.02]}


def _run(with_ranks: bool = True) -> list[dict[str, Any]]:
    events = [_ev(0.0, "run_start", run_id="rk", replicas=3, steps=6, start_step=0),
              _ev(0.5, "generation", gen=0, workers=["w0", "w1", "w2"], world_size=3,
                  build_s=0.1, reason="start")]
    events += [_commit(s, _slow_rank_2(s, last=s == 5) if with_ranks else None)
               for s in range(6)]
    events.append(_ev(7.5, "run_end", status="ok"))
    return events


def test_the_summary_names_the_slowest_rank_and_the_part_it_loses_in() -> None:
    ranks = summarize_ranks(_run())
    assert ranks is not None and ranks.width == 3
    assert (ranks.slowest, ranks.slowest_worker, ranks.slowest_part) == (2, "w2", "load")
    slow = ranks.ranks[2]
    assert slow.steps == 6 and abs((slow.load or 0) - 0.3) < 1e-9
    assert abs((ranks.ranks[0].reduce_wait or 0) - 0.3) < 1e-9  # the last step's unknown
    assert summarize_ranks(_run(with_ranks=False)) is None  # an older log


def test_a_page_of_a_wide_job_s_ranks_counts_for_those_ranks() -> None:
    events = [_commit(0, {"load": [1.0, 2.0], "compute": [0, 0], "reduce_wait": [0, 0],
                          "apply": [0, 0]}, width=4),
              _commit(1, {"first": 2, "load": [3.0, 9.0], "compute": [0, 0],
                          "reduce_wait": [0, 0], "apply": [0, 0]}, width=4)]
    ranks = summarize_ranks(events)
    assert ranks is not None
    assert [(m.rank, m.load, m.steps) for m in ranks.ranks] == [
        (0, 1.0, 1), (1, 2.0, 1), (2, 3.0, 1), (3, 9.0, 1)]
    assert ranks.slowest == 3 and ranks.slowest_worker is None


def test_the_report_shows_a_per_rank_table_json_and_panel(tmp_path: Path, capsys) -> None:
    events = _run()
    summary = summarize(events)
    out = io.StringIO()
    render_summary(summary, Console(file=out, width=140))
    text = out.getvalue()
    assert "time per rank" in text and "slowest: rank 2 (w2), in load" in text
    png = plot_timeline(events, summary, tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    old = plot_timeline(_run(with_ranks=False), summarize(_run(with_ranks=False)),
                        tmp_path / "old.png")  # no panel, as before
    assert old.stat().st_size > 0
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert report_main(run, json=True) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert ranks["slowest"] == 2 and ranks["slowest_worker"] == "w2"
    assert [r["worker"] for r in ranks["ranks"]] == ["w0", "w1", "w2"]
    assert (run / "timeline.png").stat().st_size > 0


def test_prometheus_has_a_gauge_per_rank_and_part() -> None:
    exporter = MetricsExporter(None, job="tiny", run_id="r1")
    exporter(_commit(0, _slow_rank_2(0)))
    exporter(_commit(1, _slow_rank_2(1, last=True)))  # what is not known keeps the last value
    get = exporter.registry.get_sample_value
    labels = {"run_id": "r1", "job": "tiny"}
    assert get("planaria_rank_step_seconds", {**labels, "rank": "2", "part": "load"}) == 0.3
    assert get("planaria_rank_step_seconds", {**labels, "rank": "0", "part": "reduce_wait"}) \
        == 0.3


def test_trackers_get_each_rank_s_times_and_a_bounded_set_for_wide_jobs() -> None:
    entry = tracker_entry(_commit(0, _slow_rank_2(0)))
    assert isinstance(entry, StepScalars)
    assert entry.values["time/rank2/load"] == 0.3 and entry.values["time/rank0/apply"] == 0.02
    assert entry.values["train/loss"] == 1.0
    wide = _commit(1, {"first": 0, "load": [0.1] * 15 + [0.9], "compute": [0.2] * 16,
                       "reduce_wait": [None] * 16, "apply": [0.0] * 16}, width=16)
    scalars = rank_scalars(wide)
    assert scalars["time/load/max"] == 0.9 and scalars["time/load/max_rank"] == 15.0
    assert scalars["time/load/min"] == 0.1
    assert not any(k.startswith("time/rank") for k in scalars)
    assert not any(k.startswith("time/reduce_wait") for k in scalars)
    assert len(scalars) == 9  # three parts known, three series each, whatever the width
