"""One event log, several runs: a run dir used again without resuming holds a new run, a
resumed job stays one run of several segments; the report shows one run (the latest, or
``--run ID``) and ``--all`` lists them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from planaria.observe.metrics import summarize
from planaria.observe.report import report_main
from planaria.observe.segments import UnknownRun, run_ids, select_run, split_runs


def _ev(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "event": event, **fields}


def _segment(t0: float, run_id: str, steps: range, *, resume: bool | None,
             status: str | None = "ok", loss: float = 1.0,
             lineage_mode: str | None = None) -> list[dict[str, Any]]:
    start = _ev(t0, "run_start", run_id=run_id, replicas=2, steps=steps.stop, start_step=None)
    if resume is not None:
        start["resume"] = resume
    out = [start]
    if lineage_mode is not None:
        out.append(_ev(t0 + 0.1, "checkpoint_lineage", run_id=f"c-{run_id}",
                       lineage=[f"c-{run_id}"], mode=lineage_mode))
    out += [_ev(t0 + 1 + i, "step_committed", step=s, gen=0, width=2, duration_s=1.0,
                loss=loss, samples=8, samples_per_s=8.0) for i, s in enumerate(steps)]
    if status is not None:
        out.append(_ev(t0 + 1 + len(steps), "run_end", status=status, step=steps.stop))
    return out


def _three_runs() -> list[dict[str, Any]]:
    """Job A (6 steps, crashed, then resumed: 2 segments), 700 s later job B started over
    with --no-resume (4 steps), then job C, started again with --no-resume, failed."""
    return (_segment(0.0, "aaa111", range(0, 3), resume=True, status=None)
            + _segment(10.0, "aaa222", range(3, 6), resume=True)
            + _segment(700.0, "bbb111", range(0, 4), resume=False, loss=9.0)
            + _segment(800.0, "ccc111", range(0, 1), resume=False, status="error"))


def test_a_log_is_cut_into_runs_at_each_start_that_does_not_resume() -> None:
    runs = split_runs(_three_runs())
    assert [run_ids(r) for r in runs] == [["aaa111", "aaa222"], ["bbb111"], ["ccc111"]]
    assert select_run(_three_runs()) == runs[-1]
    assert select_run(_three_runs(), "aaa222") == runs[0]  # any segment's id
    assert select_run(_three_runs(), "bbb") == runs[1]  # a prefix that fits one run
    with pytest.raises(UnknownRun, match=r"no run .* 'zzz' \(its runs: aaa111, bbb111, ccc111"):
        select_run(_three_runs(), "zzz")
    assert select_run([]) == []


def test_a_log_without_the_resume_field_reads_as_before() -> None:
    """Older logs: a ``checkpoint_lineage`` that does not resume opens a run; otherwise a
    ``run_start`` continues, as the log was always read."""
    old = (_segment(0.0, "a", range(0, 2), resume=None, lineage_mode="resume")
           + _segment(5.0, "b", range(2, 4), resume=None)
           + _segment(9.0, "c", range(0, 2), resume=None, lineage_mode="overwrite")
           + _segment(20.0, "d", range(2, 3), resume=None, lineage_mode="resume"))
    assert [run_ids(r) for r in split_runs(old)] == [["a", "b"], ["c", "d"]]


def test_the_summary_is_the_latest_run_not_a_merge() -> None:
    events = _three_runs()[:-len(_segment(800.0, "ccc111", range(0, 1), resume=False))]
    latest = summarize(events)
    assert latest.run_id == "bbb111" and latest.segments == 1 and latest.status == "ok"
    assert latest.steps["committed"] == 4 and latest.steps["commits"] == 4
    assert latest.wall_s == pytest.approx(5.0)  # not the 700 s between the runs
    assert latest.goodput > 0.5
    first = summarize(events, run="aaa111")
    assert first.run_id == "aaa111" and first.segments == 2 and first.steps["committed"] == 6


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _three_runs()))
    return tmp_path


def test_report_shows_the_latest_run_or_the_one_named(run_dir: Path, capsys) -> None:
    assert report_main(run_dir, json=True) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run_id"] == "ccc111" and out["status"] == "error"
    assert out["runs"] == ["aaa111", "bbb111", "ccc111"]
    assert report_main(run_dir, json=True, run="bbb111") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run_id"] == "bbb111" and out["steps"]["committed"] == 4
    assert out["segments"] == 1 and out["wall_s"] == pytest.approx(5.0)
    assert report_main(run_dir) == 0
    text = capsys.readouterr().out
    assert "this run dir holds 3 runs; shown: the latest" in text and "run ccc111" in text
    assert report_main(run_dir, run="nope") == 2
    assert "no run in this log with the id 'nope'" in capsys.readouterr().err


def test_report_all_lists_the_runs(run_dir: Path, capsys) -> None:
    assert report_main(run_dir, all_runs=True) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if any(i in line for i in ("aaa", "bbb", "ccc"))]
    assert len(rows) == 3
    assert "aaa111" in rows[0] and "ok" in rows[0] and "6 / 6" in rows[0]
    assert "bbb111" in rows[1] and "4 / 4" in rows[1]
    assert "ccc111" in rows[2] and "error" in rows[2]
    assert report_main(run_dir, all_runs=True, json=True) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["run_id"], r["segments"]) for r in listed] == [
        ("aaa111", 2), ("bbb111", 1), ("ccc111", 1)]


def test_the_loss_line_is_the_run_s_own(run_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """The picture is drawn from the shown run's records only (job B's loss 9.0 is not in
    job A's loss line)."""
    import planaria.observe.report as report

    drawn: list[list[dict[str, Any]]] = []
    monkeypatch.setattr(report, "plot_timeline",
                        lambda events, summary, png: drawn.append(list(events)) or Path(png))
    assert report_main(run_dir, json=True, run="aaa111", png=tmp_path / "t.png") == 0
    (events,) = drawn
    losses = {e["loss"] for e in events if e["event"] == "step_committed"}
    assert losses == {1.0} and run_ids(events) == ["aaa111", "aaa222"]
