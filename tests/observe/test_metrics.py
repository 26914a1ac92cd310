"""Recovery metrics, goodput and badput from synthetic event logs with known answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from planaria.observe.goodput import BUCKETS, GoodputTracker
from planaria.observe.metrics import Stats, percentile, summarize

Rec = dict[str, Any]


def ev(t: float, event: str, **fields: Any) -> Rec:
    return {"t": t, "event": event, **fields}


def start(t: float = 0.0, replicas: int = 3, steps: int = 10, start_step: int = 0) -> Rec:
    return ev(t, "run_start", run_id="r1", replicas=replicas, steps=steps,
              start_step=start_step, global_batch_size=12)


def commit(t: float, step: int, dur: float = 1.0, width: int = 3, wait: float = 0.0,
           samples: int = 12) -> Rec:
    return ev(t, "step_committed", step=step, gen=0, width=width, duration_s=dur,
              loss=1.0 / (step + 1), samples=samples, samples_per_s=samples / dur,
              data_wait_s=wait, metrics={})


def fault(t: float, fid: str | int, fault_t: float, worker: str = "w2", step: int = 3,
          kind: str = "worker_lost") -> list[Rec]:
    return [ev(t, "fault", fault_id=fid, kind=kind, worker=worker, step=step, fault_t=fault_t,
               message="boom"),
            ev(t, "detected", fault_id=fid, kind=kind, worker=worker, detect_s=t - fault_t)]


def check_sums(summary: Any) -> None:
    total = summary.goodput + sum(summary.badput.values())
    assert total == pytest.approx(1.0)
    assert summary.goodput_s + sum(summary.badput_s.values()) == pytest.approx(summary.wall_s)


def test_empty_log() -> None:
    s = summarize([])
    assert s.wall_s == 0 and s.goodput == 0 and s.faults == [] and s.status == "empty"
    assert s.recover_s == Stats()
    out = s.to_json()
    json.dumps(out)
    assert out["fault_totals"]["faults"] == 0


def test_no_faults() -> None:
    events = [start(replicas=2, steps=3), ev(1.0, "generation", gen=0, workers=["w0", "w1"],
                                                world_size=2, build_s=0.1, reason="start"),
              commit(2.0, 0, width=2, wait=0.1), commit(3.0, 1, width=2), commit(4.0, 2, width=2),
              ev(4.5, "checkpoint_saved", step=3, path="p", bytes=100, stall_s=0.2, save_s=0.5,
                 writers=2),
              ev(5.0, "run_end", status="ok", step=2, wall_s=5.0, error=None)]
    s = summarize(events)
    check_sums(s)
    assert s.wall_s == 5.0 and s.status == "ok" and s.faults == []
    assert s.goodput_s == pytest.approx(2.9)
    assert s.badput_s["startup"] == pytest.approx(1.0)
    assert s.badput_s["data_wait"] == pytest.approx(0.1)
    assert s.badput_s["checkpoint_stall"] == pytest.approx(0.2)
    assert s.badput_s["other"] == pytest.approx(0.8)
    assert s.badput_s["recovery"] == s.badput_s["wasted_steps"] == 0
    assert s.replica_efficiency == pytest.approx(6 / 10)
    assert s.steps == {"commits": 3, "committed": 3, "recomputed": 0, "failed": 0,
                       "skipped": 0, "target": 3, "last": 2}
    assert s.samples_per_s == pytest.approx(36 / 5)
    assert s.checkpoints["saved"] == 1 and s.checkpoints["stall_s"]["total"] == pytest.approx(0.2)
    assert set(s.to_json()["badput"]) == set(BUCKETS)


def _resize_run() -> list[Rec]:
    return [start(), ev(1.0, "generation", gen=0, workers=["w0", "w1", "w2"], world_size=3,
                        build_s=0.1, reason="start"),
            commit(2.0, 0), commit(3.0, 1), commit(4.0, 2),
            ev(4.5, "chaos", action="kill", worker="w2", pid=1, step=3),
            *fault(4.6, "f1", 4.5),
            ev(4.6, "action", fault_id="f1", action="resize"),
            ev(4.6, "step_failed", step=3, gen=0, kind="worker_lost", workers=["w2"]),
            ev(4.7, "replacement_requested", worker="w3", replaces="w2"),
            ev(4.8, "generation", gen=1, workers=["w0", "w1"], world_size=2, build_s=0.1,
               reason="resize"),
            commit(5.5, 3, dur=0.7, width=2),
            ev(5.5, "recovered", fault_id="f1", step=3, recover_s=1.0, lost_steps=0),
            commit(6.5, 4, width=2),
            ev(7.0, "replacement_ready", worker="w3", replacement_s=2.3),
            ev(7.2, "generation", gen=2, workers=["w0", "w1", "w3"], world_size=3, build_s=0.2,
               reason="join"),
            commit(8.0, 5, dur=0.8),
            ev(8.0, "joined", worker="w3", gen=2, step=5, join_s=1.0),
            ev(8.5, "run_end", status="ok", step=5, wall_s=8.5, error=None)]


def test_resize_fault_metrics_and_buckets() -> None:
    s = summarize(_resize_run())
    check_sums(s)
    (f,) = s.faults
    assert (f.fault_id, f.kind, f.worker, f.step) == ("f1", "worker_lost", "w2", 3)
    assert f.detect_s == pytest.approx(0.1) and f.recover_s == 1.0 and f.lost_steps == 0
    assert (f.replacement, f.replacement_s, f.join_s, f.restore_s) == ("w3", 2.3, 1.0, None)
    assert f.action == "resize" and f.recovered
    assert s.wall_s == 8.5
    assert s.goodput_s == pytest.approx(5.5)
    assert s.badput_s["recovery"] == pytest.approx(0.3)  # [4.5, 5.5] minus the re-run [4.8, 5.5]
    assert s.badput_s["wasted_steps"] == pytest.approx(0.5)  # failed step 3 from 4.0 to fault_t
    assert s.badput_s["startup"] == pytest.approx(1.0)
    assert s.badput_s["other"] == pytest.approx(1.2)
    assert s.replica_efficiency == pytest.approx(18.5 / 25.5)
    assert s.recover_s.p50 == 1.0 and s.recover_s.max == 1.0 and s.recover_s.count == 1
    out = s.to_json()
    assert out["faults"][0]["recovered"] is True and out["fault_totals"]["by_kind"] == {
        "worker_lost": 1}


def _overlapping(own_records: bool) -> list[Rec]:
    events = [start(), commit(2.0, 0), commit(3.0, 1), commit(4.0, 2),
              *fault(4.6, "f1", 4.5), ev(4.6, "action", fault_id="f1", action="resize"),
              *fault(5.0, "f2", 4.9, worker="w1"),
              ev(5.0, "action", fault_id="f2", action="resize"),
              commit(6.0, 3, dur=0.5, width=1)]
    if own_records:
        events.append(ev(6.0, "recovered", fault_id="f1", step=3, recover_s=1.5, lost_steps=0))
    events += [ev(6.0, "recovered", fault_id="f2", step=3, recover_s=1.1, lost_steps=0),
               ev(7.0, "run_end", status="ok", step=3, wall_s=7.0, error=None)]
    return events


@pytest.mark.parametrize("own_records", [False, True])
def test_fault_during_recovery(own_records: bool) -> None:
    s = summarize(_overlapping(own_records))
    check_sums(s)
    f1, f2 = s.faults
    assert f1.recover_s == pytest.approx(1.5) and f1.recovered_t == 6.0 and f1.lost_steps == 0
    assert f2.recover_s == pytest.approx(1.1)
    # the two recovery spans overlap; their union [4.5, 6.0] minus the re-run [5.5, 6.0]
    assert s.badput_s["recovery"] == pytest.approx(1.0)
    assert s.recover_s.total == pytest.approx(2.6)
    assert s.recover_s.p50 == pytest.approx(1.3) and s.recover_s.max == pytest.approx(1.5)


def test_run_ends_mid_recovery() -> None:
    events = [start(), commit(2.0, 0), commit(3.0, 1), *fault(3.6, "f1", 3.5),
              ev(3.6, "action", fault_id="f1", action="pause"),
              ev(5.0, "run_end", status="aborted", step=1, wall_s=5.0, error="timeout")]
    s = summarize(events)
    check_sums(s)
    (f,) = s.faults
    assert f.recover_s is None and f.lost_steps is None and not f.recovered
    assert s.to_json()["fault_totals"]["unrecovered"] == 1
    assert s.recover_s.count == 0 and s.detect_s.count == 1
    assert s.badput_s["waiting_for_replicas"] == pytest.approx(1.4)  # pause → end of run
    assert s.badput_s["recovery"] == pytest.approx(0.1)  # fault_t → pause
    assert s.status == "aborted"


def test_pause_then_replacement() -> None:
    events = [start(), commit(2.0, 0), commit(3.0, 1), commit(4.0, 2), *fault(4.6, "f1", 4.5),
              ev(4.6, "action", fault_id="f1", action="pause"),
              ev(4.6, "step_failed", step=3, gen=0, kind="worker_lost", workers=["w2"]),
              ev(4.7, "replacement_requested", worker="w3", replaces="w2"),
              ev(6.0, "replacement_ready", worker="w3", replacement_s=1.3),
              ev(6.1, "generation", gen=1, workers=["w0", "w1", "w3"], world_size=3, build_s=0.1,
                 reason="join"),
              commit(7.0, 3, dur=0.8), ev(7.0, "recovered", fault_id="f1", step=3, recover_s=2.5,
                                          lost_steps=0),
              ev(7.0, "joined", worker="w3", gen=1, step=3, join_s=1.0),
              ev(7.5, "run_end", status="ok", step=3, wall_s=7.5, error=None)]
    s = summarize(events)
    check_sums(s)
    assert s.badput_s["waiting_for_replicas"] == pytest.approx(1.6)
    assert s.badput_s["recovery"] == pytest.approx(0.1)
    assert s.badput_s["wasted_steps"] == pytest.approx(0.5)
    (f,) = s.faults
    assert (f.replacement_s, f.join_s, f.recover_s) == (1.3, 1.0, 2.5)


def test_in_process_restore_counts_lost_steps() -> None:
    events = [start(), commit(2.0, 0), commit(3.0, 1), commit(4.0, 2), commit(5.0, 3),
              *fault(5.6, "f1", 5.5, kind="all_lost", worker=None),  # type: ignore[arg-type]
              ev(5.6, "action", fault_id="f1", action="restore"),
              ev(6.5, "restore", step=2, path="ck", restore_s=0.5, lost_steps=2),
              commit(7.5, 2), commit(8.5, 3),
              ev(8.5, "run_end", status="ok", step=3, wall_s=8.5, error=None)]
    s = summarize(events)
    check_sums(s)
    (f,) = s.faults  # no recovered record: closed by the first commit after it
    assert f.recover_s == pytest.approx(2.0) and f.restore_s == 0.5 and f.lost_steps == 2
    assert s.steps["recomputed"] == 2 and s.steps["committed"] == 4
    assert s.badput_s["wasted_steps"] == pytest.approx(2.0)  # first runs of steps 2 and 3
    assert s.badput_s["restore"] == pytest.approx(0.5)
    assert s.badput_s["recovery"] == pytest.approx(2.0 - 0.5 - 1.0)
    assert s.goodput_s == pytest.approx(4.0)


def test_resumed_run() -> None:
    events = [start(), commit(2.0, 0), commit(3.0, 1), commit(4.0, 2),
              ev(4.5, "checkpoint_saved", step=3, path="p", bytes=1, stall_s=0.1, save_s=0.4,
                 writers=3),
              commit(5.0, 3), commit(6.0, 4),  # then the controller crashed
              start(10.0, start_step=3),
              ev(11.5, "restore", step=3, path="p", restore_s=0.5, lost_steps=2),
              commit(13.0, 3), commit(14.0, 4), commit(15.0, 5),
              ev(15.5, "run_end", status="ok", step=5, wall_s=5.5, error=None)]
    s = summarize(events)
    check_sums(s)
    assert s.segments == 2 and s.wall_s == 15.5
    assert s.badput_s["downtime"] == pytest.approx(4.0)
    assert s.badput_s["wasted_steps"] == pytest.approx(1.9)  # steps 3, 4 of the first run - stall
    assert s.badput_s["checkpoint_stall"] == pytest.approx(0.1)
    assert s.badput_s["restore"] == pytest.approx(0.5)
    assert s.badput_s["startup"] == pytest.approx(1.0 + 1.5)
    assert s.goodput_s == pytest.approx(6.0)
    assert s.steps["committed"] == 6 and s.steps["recomputed"] == 2
    # width 3 during steps and between commits, 0 in startup, tail and downtime
    assert s.replica_efficiency == pytest.approx(3 * (5 + 3) / (3 * 15.5))


def test_damaged_log_reports_around_the_damage(tmp_path: Path) -> None:
    lines = [json.dumps(r) for r in _resize_run()]
    lines[6] = lines[6][:10]  # the fault record, garbled: `detected` stands in for it
    text = "\n".join(lines[:-1]) + "\n" + lines[-1][:15]  # torn tail: run_end lost
    (tmp_path / "events.jsonl").write_text(text)
    s = summarize(tmp_path)
    assert len(s.warnings) == 2 and "damaged line" in s.warnings[0]
    assert s.status == "incomplete" and s.wall_s == 8.0  # ends at the last readable record
    (f,) = s.faults
    assert (f.fault_id, f.worker, f.step, f.fault_t) == ("f1", "w2", None, pytest.approx(4.5))
    assert f.recover_s == 1.0 and f.join_s == 1.0 and f.replacement_s == 2.3
    assert s.goodput_s == pytest.approx(5.5)
    assert s.to_json()["warnings"] == s.warnings


def test_log_without_run_start_warns() -> None:
    s = summarize([commit(2.0, 0), commit(3.0, 1)])
    assert s.wall_s == 1.0 and any("run_start" in w for w in s.warnings)
    assert s.replica_efficiency == pytest.approx(1.0)


def test_percentile_and_stats() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5
    assert percentile([float(i) for i in range(1, 11)], 0.9) == pytest.approx(9.1)
    st = Stats.of([1.0, None, 3.0])
    assert (st.count, st.total, st.mean, st.max) == (2, 4.0, 2.0, 3.0)


def test_goodput_tracker_matches_offline_without_stalls() -> None:
    tracker = GoodputTracker()
    events = _resize_run()
    for rec in events:
        tracker.observe(rec)
    assert tracker.ratio == pytest.approx(summarize(events).goodput)


def test_fault_of_several_workers_takes_the_slowest_replacement() -> None:
    events = [start(), commit(2.0, 0), *fault(2.6, 1, 2.5, worker="w1,w2"),
              ev(2.6, "action", fault_id=1, action="pause"),
              ev(2.7, "replacement_requested", worker="w3", replaces="w1"),
              ev(2.7, "replacement_requested", worker="w4", replaces="w2"),
              ev(4.0, "replacement_ready", worker="w3", replacement_s=1.3),
              ev(5.0, "replacement_ready", worker="w4", replacement_s=2.3),
              commit(6.0, 1), ev(6.0, "recovered", fault_id=1, step=1, recover_s=3.5, lost_steps=0),
              ev(6.0, "joined", worker="w3", gen=1, step=1, join_s=2.0),
              ev(6.0, "joined", worker="w4", gen=1, step=1, join_s=1.0),
              ev(6.5, "run_end", status="ok", step=1, wall_s=6.5, error=None)]
    s = summarize(events)
    check_sums(s)
    (f,) = s.faults
    assert f.workers == ["w1", "w2"] and f.replacement == "w3,w4"
    assert (f.replacement_s, f.join_s, f.recover_s) == (2.3, 2.0, 3.5)
