"""planaria report: terminal summary, timeline PNG and the --json object."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from planaria.observe.metrics import summarize
from planaria.observe.report import plot_timeline, render_summary, report_main


def _ev(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "event": event, **fields}


def _commit(t: float, step: int, width: int = 3) -> dict[str, Any]:
    return _ev(t, "step_committed", step=step, gen=0, width=width, duration_s=0.9,
               loss=2.0 / (step + 1), samples=12, samples_per_s=12 / 0.9, data_wait_s=0.01,
               metrics={})


def _run() -> list[dict[str, Any]]:
    events = [_ev(0.0, "run_start", run_id="rep", replicas=3, steps=20, start_step=0),
              _ev(0.5, "generation", gen=0, workers=["w0", "w1", "w2"], world_size=3, build_s=0.1,
                  reason="start")]
    events += [_commit(1.0 + i, i) for i in range(8)]
    events += [_ev(8.9, "checkpoint_saved", step=7, path="ck", bytes=10, stall_s=0.05, save_s=0.3,
                   writers=3),
               _ev(9.1, "fault", fault_id="f1", kind="worker_lost", worker="w1", step=8,
                   fault_t=9.0, message="died"),
               _ev(9.1, "detected", fault_id="f1", kind="worker_lost", worker="w1", detect_s=0.1),
               _ev(9.1, "action", fault_id="f1", action="resize"),
               _ev(9.1, "replacement_requested", worker="w3", replaces="w1")]
    events += [_commit(10.0 + i, 8 + i, width=2) for i in range(4)]
    events += [_ev(10.0, "recovered", fault_id="f1", step=8, recover_s=1.0, lost_steps=0),
               _ev(12.5, "replacement_ready", worker="w3", replacement_s=3.4),
               _ev(14.0, "joined", worker="w3", gen=2, step=12, join_s=1.5)]
    events += [_commit(14.0 + i, 12 + i) for i in range(8)]
    events.append(_ev(21.5, "run_end", status="ok", step=19, wall_s=21.5, error=None))
    return events


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _run()))
    return tmp_path


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_summary_shows_tables() -> None:
    out = io.StringIO()
    render_summary(summarize(_run()), Console(file=out, width=120))
    text = out.getvalue()
    for word in ("goodput", "worker_lost", "w1", "recover_s", "where the time went", "startup"):
        assert word in text
    assert "\x1b[" not in text


def test_plot_timeline_writes_png(tmp_path: Path) -> None:
    events = _run()
    png = plot_timeline(events, summarize(events), tmp_path / "sub" / "t.png")
    assert png.exists() and _is_png(png) and png.stat().st_size > 20_000


def test_plot_timeline_of_empty_log(tmp_path: Path) -> None:
    png = plot_timeline([], summarize([]), tmp_path / "t.png")
    assert _is_png(png)


def test_report_main_default_png_and_console(run_dir: Path, capsys: Any) -> None:
    assert report_main(run_dir) == 0
    assert _is_png(run_dir / "timeline.png")
    out = capsys.readouterr().out
    assert "faults" in out and "timeline.png" in out


def test_report_main_json_is_one_object(run_dir: Path, tmp_path: Path, capsys: Any) -> None:
    png = tmp_path / "elsewhere.png"
    assert report_main(run_dir, json=True, png=png) == 0
    data = json.loads(capsys.readouterr().out)  # the whole stdout is one JSON object
    for key in ("goodput", "badput", "faults", "steps", "replica_efficiency", "wall_s",
                "samples_per_s", "recover_s", "checkpoints", "warnings"):
        assert key in data
    assert data["timeline_png"] == str(png) and _is_png(png)
    assert data["faults"][0]["fault_id"] == "f1" and data["faults"][0]["join_s"] == 1.5
    assert data["recover_s"]["max"] == 1.0 and data["steps"]["committed"] == 20
    assert data["goodput"] + sum(data["badput"].values()) == pytest.approx(1.0)


def test_report_shows_the_resolved_config(run_dir: Path, capsys: Any) -> None:
    (run_dir / "config.json").write_text(json.dumps({"replicas": 3, "steps": 20}))
    assert report_main(run_dir, json=True, png=run_dir / "t.png") == 0
    assert json.loads(capsys.readouterr().out)["config"] == {"replicas": 3, "steps": 20}
    assert report_main(run_dir) == 0
    assert "replicas=3" in capsys.readouterr().out


def test_report_main_damaged_log_warns(run_dir: Path, capsys: Any) -> None:
    with (run_dir / "events.jsonl").open("a") as f:
        f.write('{"t": 22.0, "event": "run_st')
    assert report_main(run_dir, json=True) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["warnings"]) == 1 and data["status"] == "ok"


def test_report_main_without_log(tmp_path: Path, capsys: Any) -> None:
    assert report_main(tmp_path / "nope") == 2
    assert "no event log" in capsys.readouterr().err


def test_the_report_shows_the_last_evaluation_and_the_list() -> None:
    def ev(t: float, step: int, loss: float) -> dict[str, Any]:
        return _ev(t, "eval", step=step, metrics={"loss": loss, "acc": 0.5}, samples=100,
                   seconds=0.25, width=3)

    events = _run()
    # Step 8's evaluation failed once and ran again: recorded once, the last figures.
    events[-1:-1] = [ev(5.0, 4, 0.9), ev(13.0, 8, 0.7), ev(14.0, 8, 0.6), ev(21.0, 16, 0.4)]
    summary = summarize(events)
    assert [e["step"] for e in summary.evals] == [4, 8, 16]
    assert summary.evals[1]["metrics"] == {"loss": 0.6, "acc": 0.5}
    assert summary.to_json()["evals"][-1] == {"step": 16, "metrics": {"loss": 0.4, "acc": 0.5},
                                              "samples": 100, "seconds": 0.25}
    out = io.StringIO()
    render_summary(summary, Console(file=out, width=120))
    text = out.getvalue()
    assert "last eval" in text and "step 16: loss 0.4, acc 0.5 (100 samples)" in text
    assert "evaluations" in text and "loss 0.6, acc 0.5" in text
    assert summarize(_run()).evals == []
