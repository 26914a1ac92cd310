"""The goodput bench's result from raw records (bench/goodput_summary.py, goodput_figures.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import goodput_figures, goodput_summary, records  # noqa: E402


def _raw(system: str, variant: str, repeat: int, step_s: float, *, kills=(30.0, 60.0, 90.0),
         lost_s: float = 0.5, slots: int = 3, kind: str = "faults", events=None) -> dict:
    """A run of 120 s: a step every ``step_s``, ``lost_s`` of nothing after each kill."""
    kills = () if kind == "control" else kills
    commits, wall, step = [], 0.0, 0
    while True:
        pause = next((lost_s for k in kills if k <= wall < k + lost_s), 0.0)
        wall += pause or step_s
        if wall > 120.0:
            break
        if not pause:
            step += 1
            commits.append({"step": step, "wall": wall, "width": 3, "started": wall - step_s})
    return {"system": system, "variant": variant, "repeat": repeat, "seed": repeat,
            "kind": kind, "t0": 0.0, "t1": 120.0, "commits": commits, "replicas": 3,
            "slots": slots, "global_batch": 48, "regime": "fast", "commit": "c0ffee",
            "config": {"v": variant}, "kill_every_s": 30.0, "size": "medium",
            "duration_s": 120.0, "command": "python bench/goodput.py",
            "kills": [{"t_kill": k, "worker": "w1"} for k in kills],
            "events": events or []}


def _raws() -> dict[str, dict]:
    out = {}
    for rep, speed in enumerate((0.05, 0.08, 0.11)):  # the machine differs between repeats
        out[f"planaria_spares-r{rep}"] = _raw("planaria_spares", "planaria_spares", rep, speed,
                                              lost_s=0.1, slots=4)
        out[f"planaria-r{rep}"] = _raw("planaria", "planaria", rep, speed, lost_s=0.3)
        out[f"torchrun_ckpt5-r{rep}"] = _raw("torchrun", "torchrun_ckpt5", rep, speed,
                                             lost_s=3.0)
        out[f"torchrun_ckpt10-r{rep}"] = _raw("torchrun", "torchrun_ckpt10", rep, speed,
                                              lost_s=2.0)
    out["planaria-control"] = _raw("planaria", "planaria", -1, 0.05, kind="control")
    return out


def test_a_control_run_reads_one_and_reports_its_step_rate():
    out = goodput_summary.summarize(_raws())
    control = out["detail"]["controls"]["planaria"]
    assert control["goodput"] == pytest.approx(1.0, abs=0.002)
    assert control["step_ms"] == pytest.approx(50.0, rel=0.01)
    assert control["samples_per_s"] == pytest.approx(48 / 0.05, rel=0.01)


def test_the_output_shape_spares_charged_per_slot_and_best_variant_per_repeat():
    out = goodput_summary.summarize(_raws())
    assert list(out)[:8] == ["bench", "regime", "commit", "planaria", "planaria_spares",
                             "peers", "ratio_goodput_vs_best_peer",
                             "ratio_samples_per_s_vs_best_peer"]
    assert out["regime"] == "fast" and out["commit"] == "c0ffee"
    for key in ("planaria", "planaria_spares"):
        assert {"goodput", "floor", "samples_per_s", "lost_work_per_kill_steps",
                "targets"} <= out[key].keys()
    sp = out["planaria_spares"]
    assert sp["goodput_per_slot"] == pytest.approx(sp["goodput"] * 3 / 4, abs=1e-3)
    assert sp["ratio_uses"] == "per_slot"
    assert out["planaria"]["goodput_per_slot"] == out["planaria"]["goodput"]  # no spare
    assert out["peers"].keys() == {"torchrun"}  # planaria's configurations are not peers
    assert out["peers"]["torchrun"]["config"] == {"v": "torchrun_ckpt10"}  # lost less
    assert out["detail"]["chosen_variant"]["torchrun"] == ["torchrun_ckpt10"] * 3
    # The headline is planaria without a spare (lost 0.3 s a kill, torchrun 2 s): ahead.
    ratio = out["ratio_goodput_vs_best_peer"]
    assert ratio["median"] > 1 and ratio["ahead"] is True
    assert ratio["ci95"][0] <= ratio["median"] <= ratio["ci95"][1]
    # Charged for its fourth slot, planaria with a spare is behind: reported, not hidden.
    spares = out["detail"]["spares_ratio_goodput_vs_best_peer"]
    assert spares["median"] < 1 and spares["ahead"] is False


def test_paired_ratios_cancel_what_a_repeat_shared():
    # Each repeat ran on a machine of another speed: planaria's samples/s vary 2x across the
    # repeats, yet paired with the peer of the same repeat the ratio hardly moves.
    out = goodput_summary.summarize(_raws())
    per_peer = out["detail"]["ratio_vs_each_peer"]["samples_per_s"]["torchrun"]
    lo, hi = per_peer["ci95"]
    assert hi - lo < 0.01


def test_lost_work_and_floor_from_planaria_events():
    events = [{"event": "step_resumed", "t": 30.2, "redone": 2, "total": 6},
              {"event": "fault", "t": 30.1, "worker": "w1"},
              {"event": "fault", "t": 60.05, "worker": "w1"},
              {"event": "fault", "t": 90.1, "worker": "w1"},
              {"event": "state_transfer", "t": 33.0, "seconds": 0.3}]
    raw = _raw("planaria_spares", "planaria_spares", 0, 0.05, events=events)
    # kill 1: a third redone; kills 2 and 3: no record, the step had committed
    assert goodput_figures.lost_work_per_kill(raw) == pytest.approx(1 / 9)
    parts = goodput_figures.floor_figures(raw, 0.05)
    assert parts["floor_parts_s"]["detect_s"] == pytest.approx(0.25 / 3, abs=1e-3)
    assert parts["floor_parts_s"]["transfer_stall_s"] == pytest.approx(0.1)
    per_kill = 0.25 / 3 + 0.05 / 9 + 0.1
    assert parts["floor"] == pytest.approx(1 - 3 * per_kill / 120, abs=1e-4)
    assert goodput_figures.lost_work_per_kill({**raw, "events": events[1:]}) is None
    # a survivor had not begun one of the three redone: lost is the dead's two only
    begun = [{**events[0], "redone": 3, "unstarted": 1}, *events[1:]]
    assert goodput_figures.lost_work_per_kill({**raw, "events": begun}) == pytest.approx(1 / 9)
    assert goodput_figures.floor_figures({**raw, "events": events[1:]}, 0.05)["floor"] is None


def test_rescore_from_written_records_gives_the_same_json(tmp_path):
    folder = records.raw_dir(tmp_path, "goodput", "fast", "c0ffee")
    raws = _raws()
    for name, raw in raws.items():
        records.write_raw(folder, name, raw)
    direct = goodput_summary.summarize(json.loads(json.dumps(raws)))
    again = goodput_summary.summarize(records.read_raw(folder))
    assert json.dumps(direct, sort_keys=True) == json.dumps(again, sort_keys=True)
