"""The goodput bench's result from raw records (bench/goodput_summary.py, goodput_figures.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import goodput_figures, goodput_parts, goodput_summary, records  # noqa: E402


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


def test_a_transfer_beside_the_step_charges_its_first_step_over_the_fault_free_one():
    # commits every 1 s; the transfer (its model part 0.1 s) ends at 10.2, the next commit
    # at 11.5: 1.3 s for a 1 s step, 0.3 s charged beside the 0.1
    commits = [{"step": i, "wall": float(i), "width": 3, "started": i - 1.0} for i in range(11)]
    commits.append({"step": 11, "wall": 11.5, "width": 3, "started": 10.2})
    run = {"t0": 0.0, "t1": 20.0, "commits": commits,
           "events": [{"event": "state_transfer", "t": 10.2, "seconds": 0.1, "beside": True}]}
    assert goodput_figures.transfer_stall_s(run, 1.0) == pytest.approx(0.4)
    before = {**run, "events": [{**run["events"][0], "beside": False}]}
    assert goodput_figures.transfer_stall_s(before, 1.0) == pytest.approx(0.1)
    fast = {**run, "commits": [*commits[:-1], {**commits[-1], "wall": 11.0}]}
    assert goodput_figures.transfer_stall_s(fast, 1.0) == pytest.approx(0.1)  # none over


def test_steps_slowed_by_a_spare_starting_are_charged_not_taken_as_fault_free():
    # a step every 0.05 s, 0.06 s while the spare started after each kill runs (its kill
    # to 20 s later, past the 10 s the baseline leaves out after a kill anyway)
    kills, commits, wall, step = (30.0, 60.0, 90.0), [], 0.0, 0
    while wall <= 120.0:
        slowed = any(k <= wall < k + 20.0 for k in kills)
        wall += 0.06 if slowed else 0.05
        step += 1
        commits.append({"step": step, "wall": wall, "width": 3, "started": wall - 0.05})
    starts = [e for k in kills for e in (
        {"event": "spare_requested", "t": k + 0.2, "worker": f"w{k:.0f}"},
        {"event": "spare_ready", "t": k + 20.0, "worker": f"w{k:.0f}"})]
    raw = {**_raw("planaria_spares", "planaria_spares", 0, 0.05), "commits": commits}
    assert goodput_figures.spare_starts({**raw, "events": starts})[0] == (30.2, 50.0)
    # a spare taken as the replacement while still starting: its start ends once set up
    adopted = [starts[0], {"event": "worker_started", "t": 41.0, "worker": "w30"}]
    assert goodput_figures.spare_starts({"events": adopted}) == [(30.2, 41.0)]
    assert goodput_figures.spare_starts({"events": starts[:1]}) == [(30.2, float("inf"))]
    charged = goodput_figures.window_figures({**raw, "events": starts}, 3)
    # the fault-free step is 0.05 s in every stretch: 60 slowed seconds lose 1/6 of theirs
    assert charged["step_ms"] == pytest.approx(50.0, rel=1e-3)
    assert charged["goodput"] == pytest.approx(1 - 60 / 6 / 120, abs=2e-3)
    absorbed = goodput_figures.window_figures(raw, 3)  # no records of the spares
    assert absorbed["goodput"] > charged["goodput"] + 0.02


def test_rescore_from_written_records_gives_the_same_json(tmp_path):
    folder = records.raw_dir(tmp_path, "goodput", "fast", "c0ffee")
    raws = _raws()
    for name, raw in raws.items():
        records.write_raw(folder, name, raw)
    direct = goodput_summary.summarize(json.loads(json.dumps(raws)))
    again = goodput_summary.summarize(records.read_raw(folder))
    assert json.dumps(direct, sort_keys=True) == json.dumps(again, sort_keys=True)


# ---- a repeat run in parts (bench/goodput.py --parts, bench/goodput_parts.py) ----------------


def _in_parts(raw: dict, parts: int) -> list[dict]:
    """``raw``'s window cut in ``parts`` runs: each the same commits and kills, its own
    window (the figures of a part count only what falls in it)."""
    span = (raw["t1"] - raw["t0"]) / parts
    return [{**raw, "t0": raw["t0"] + k * span, "t1": raw["t0"] + (k + 1) * span,
             "duration_s": span, "part": k, "parts": parts} for k in range(parts)]


def test_a_repeat_in_parts_reads_as_its_window_in_one_run():
    raw = _raw("torchrun", "torchrun_ckpt5", 0, 0.05, kills=(20.0, 50.0, 80.0, 110.0),
               lost_s=2.0)
    whole = goodput_summary.run_figures(raw)
    combined = goodput_parts.combine_parts(
        [goodput_summary.run_figures(p) for p in _in_parts(raw, 4)])
    for key in ("useful_steps", "lost_steps", "kills", "recoveries"):
        assert combined[key] == whole[key], key
    assert combined["window_s"] == pytest.approx(whole["window_s"])
    assert combined["parts"] == 4
    for key in ("goodput", "samples_per_s", "step_ms", "mttr_s_p50"):
        assert combined[key] == pytest.approx(whole[key], rel=2e-3), key
    assert combined["goodput"] < 0.99  # the kills cost: not a vacuous 1


def test_parts_weigh_by_what_a_figure_is_a_mean_of():
    a = {"window_s": 100.0, "useful_steps": 10, "kills": 1, "goodput": 0.9, "step_ms": 100.0,
         "lost_work_per_kill_steps": 0.3, "mttr_s": [1.0], "mttr_s_p50": 1.0,
         "floor_parts_s": {"detect_s": 0.1}, "commit": "c0ffee"}
    b = {"window_s": 300.0, "useful_steps": 30, "kills": 3, "goodput": 0.5, "step_ms": 200.0,
         "lost_work_per_kill_steps": 0.1, "mttr_s": [3.0, 5.0, None], "mttr_s_p50": 4.0,
         "floor_parts_s": {"detect_s": 0.5}, "commit": "c0ffee"}
    out = goodput_parts.combine_parts([a, b])
    assert out["window_s"] == 400.0 and out["useful_steps"] == 40 and out["kills"] == 4
    assert out["goodput"] == pytest.approx((0.9 * 100 + 0.5 * 300) / 400)
    assert out["step_ms"] == pytest.approx((100 * 10 + 200 * 30) / 40)
    assert out["lost_work_per_kill_steps"] == pytest.approx((0.3 + 0.1 * 3) / 4)
    assert out["floor_parts_s"]["detect_s"] == pytest.approx((0.1 + 0.5 * 3) / 4)
    assert out["mttr_s"] == [1.0, 3.0, 5.0, None] and out["mttr_s_p50"] == 3.0
    assert out["commit"] == "c0ffee"


def test_summarize_pairs_repeats_in_parts_and_leaves_out_an_incomplete_one():
    raws = {}
    for rep, speed in enumerate((0.05, 0.08, 0.11)):
        for system, variant, lost in (("planaria", "planaria", 0.3),
                                      ("torchrun", "torchrun_ckpt5", 3.0)):
            run = _raw(system, variant, rep, speed, lost_s=lost, kills=(30.0, 50.0, 90.0))
            for part in _in_parts(run, 2):
                raws[f"{variant}-r{rep}-p{part['part']}"] = part
    out = goodput_summary.summarize(raws)
    assert out["detail"]["repeats"] == [0, 1, 2] and out["detail"]["incomplete"] == []
    assert out["detail"]["setup"]["parts"] == 2
    assert out["detail"]["setup"]["duration_s"] == 120.0  # the parts' windows together
    run = out["detail"]["runs"]["planaria"]["0"]["planaria"]
    assert run["name"] == "planaria-r0" and run["parts"] == 2 and run["kills"] == 3
    assert out["ratio_goodput_vs_best_peer"]["ahead"] is True
    del raws["torchrun_ckpt5-r2-p1"]  # a sitting cut short: no pair in repeat 2
    cut = goodput_summary.summarize(raws)
    assert cut["detail"]["incomplete"] == ["torchrun_ckpt5-r2: 1 of 2 parts"]
    assert not cut["detail"]["runs"]["torchrun"]["2"]
    assert cut["ratio_goodput_vs_best_peer"]["n"] == 2
    assert cut["detail"]["setup"]["duration_s"] == 120.0  # not the lone part's 60
    del raws["planaria-r2-p0"], raws["planaria-r2-p1"]  # repeat 2: one lone part left
    assert goodput_summary.summarize(raws)["detail"]["repeats"] == [0, 1]


def test_parts_alternate_the_systems_and_share_out_the_whole_windows_kills():
    from bench import goodput
    from bench.kill_harness import plan_kills

    args = goodput.parse_args(["--regime", "realistic", "--no-controls", "--repeats", "1",
                               "--systems", "planaria,torchrun", "--torchrun-ckpt-every", "16"])
    assert args.parts == 4  # the realistic regime's default
    plan = goodput.plan_runs(args)
    assert [r.name for r in plan] == [
        "planaria-r0-p0", "torchrun_ckpt16-r0-p0", "torchrun_ckpt16-r0-p1", "planaria-r0-p1",
        "planaria-r0-p2", "torchrun_ckpt16-r0-p2", "torchrun_ckpt16-r0-p3", "planaria-r0-p3"]
    whole = plan_kills(0, args.kill_every_s, args.duration_s)
    shared = [k.at_s + goodput.part_window(args.duration_s, r)[0]
              for r in plan if r.system == "planaria"
              for k in goodput.part_kills(r.seed, args.kill_every_s, args.duration_s, r)]
    assert shared == pytest.approx([k.at_s for k in whole]) and len(whole) == 19
    for r in plan:
        assert all(0 <= k.at_s < 300 for k in goodput.part_kills(
            r.seed, args.kill_every_s, args.duration_s, r))
    one = goodput.plan_runs(goodput.parse_args(["--regime", "fast", "--no-controls",
                                                "--repeats", "1", "--systems", "planaria"]))
    assert [r.name for r in one] == ["planaria-r0"]  # the fast regime: one run a repeat
