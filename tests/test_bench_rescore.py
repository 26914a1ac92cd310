"""BENCHMARKS.md from raw records: ``make_benchmarks_md --rescore``, stale sections marked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from bench import make_benchmarks_md as mk  # noqa: E402
from bench import records, recovery_summary  # noqa: E402
from test_bench_goodput_summary import _raws  # noqa: E402


def test_rescore_writes_the_summary_and_the_page_marks_other_commits(tmp_path, monkeypatch):
    monkeypatch.setattr(mk, "RESULTS", tmp_path)
    folder = records.raw_dir(tmp_path / "raw", "goodput", "fast", "c0ffee")
    for name, raw in _raws().items():
        records.write_raw(folder, name, {**raw, "loadavg_before": "1.0 1.0 1.0",
                                         "loadavg_after": "2.0 2.0 2.0"})
    written = mk.rescore()
    assert written == [tmp_path / "goodput-fast.json"]
    saved = json.loads(written[0].read_text())
    assert saved["commit"] == "c0ffee" and saved["command"] == "python bench/goodput.py"
    assert saved["loadavg_before"] == "1.0 1.0 1.0" and saved["loadavg_after"] == "2.0 2.0 2.0"
    text = mk.render(mk.load_results())
    assert "## Goodput under repeated faults, `fast` regime" in text
    assert "**From c0ffee**" in text
    assert "| goodput ÷ best peer | 1." in text and "kill seeds 0, 1, 2" in text
    assert "| with a spare, goodput per slot ÷ best peer | 0.7" in text


def test_another_kill_rate_is_a_section_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(mk, "RESULTS", tmp_path)
    for regime in ("realistic", "realistic-kill30s"):
        folder = records.raw_dir(tmp_path / "raw", "goodput", regime, "c0ffee")
        for name, raw in _raws().items():
            records.write_raw(folder, name, {**raw, "regime": regime})
    mk.rescore()
    titles = [line for line in mk.render(mk.load_results()).splitlines()
              if line.startswith("## Goodput")]
    assert titles == ["## Goodput under repeated faults, `realistic` regime",
                      "## Goodput under repeated faults, `realistic-kill30s` regime"]
    # An earlier code's records of the same regime, kept beside under a tag, say it.
    (tmp_path / "goodput-realistic-c0ffee.json").write_text(
        (tmp_path / "goodput-realistic.json").read_text())
    titles = [line for line in mk.render(mk.load_results()).splitlines()
              if line.startswith("## Goodput")]
    assert titles[:2] == ["## Goodput under repeated faults, `realistic` regime",
                          "## Goodput under repeated faults, `realistic` regime, c0ffee"]


def test_no_mark_for_this_checkouts_commit():
    head = (mk.commit() or "").removesuffix("-dirty")
    assert mk.stale_mark({"commit": head + "-dirty"}, head) is None
    assert "from" in (mk.stale_mark({"commit": "abc"}, head or "def") or "").lower()


def test_runs_at_several_commits_keep_their_dirty_mark():
    """A run from a dirty tree is not its commit's: the page says which runs were."""
    mark = mk.stale_mark({"commit": ["a" * 40, "a" * 40 + "-dirty", "b" * 40]}, "c" * 40)
    assert f"**From commits {'a' * 12}, {'a' * 12}-dirty, {'b' * 12}**" in (mark or "")


def test_a_run_from_a_dirty_tree_says_so_in_its_header_and_mark():
    """One commit, as several: a record made from a dirty tree is not its commit's."""
    rec = {"command": "python bench/x.py", "date": "2026-12-06", "result": {},
           "commit": "a" * 40 + "-dirty"}
    assert f"commit `{'a' * 12}-dirty`" in mk._header(rec)[0]
    assert f"commit `{'a' * 12}`" in mk._header({**rec, "commit": "a" * 40})[0]
    assert f"**From {'a' * 12}-dirty**" in (mk.stale_mark(rec, "c" * 40) or "")


def test_recovery_pairs_each_repeat():
    raws = {}
    for rep, (pl, ft) in enumerate(((0.1, 0.3), (0.2, 0.6), (0.4, 1.2))):
        base = {"repeat": rep, "seed": rep, "commit": "c", "recover_s": 0.1, "lost_steps": 0}
        raws[f"planaria-r{rep}"] = {**base, "system": "planaria", "back_s": pl,
                                    "step_resumed": [{"redone": 1, "total": 6}]}
        raws[f"torchft-r{rep}"] = {**base, "system": "torchft", "back_s": ft,
                                   "config": {"heartbeat_ms": 100}}
    out = recovery_summary.summarize(raws)
    assert out["speedup_vs_torchft"] == pytest.approx(3.0)
    assert out["speedup_vs_torchft_ci95"] == pytest.approx([3.0, 3.0])
    assert out["speedup_vs_torchft_ahead"] is True
    assert out["torchft"]["config"] == {"heartbeat_ms": 100}
    assert out["planaria"]["lost_work_per_kill_steps"] == pytest.approx(1 / 6, abs=1e-4)


def test_a_summary_names_the_machine_its_runs_ran_on(tmp_path, monkeypatch):
    monkeypatch.setattr(mk, "RESULTS", tmp_path)
    amd = {"nproc": 2, "cpu": "AMD EPYC", "mem_gib": 23.5}
    intel = {"nproc": 2, "cpu": "Intel(R) Xeon(R) Processor", "mem_gib": 23.5}
    folder = records.raw_dir(tmp_path / "raw", "goodput", "realistic", "c0ffee")
    for name, raw in _raws().items():
        records.write_raw(folder, name, {**raw, "machine": amd})
    [written] = mk.rescore()
    assert json.loads(written.read_text())["machine"] == amd  # every run's: the summary's
    assert "Runs by the machine" not in mk.render(mk.load_results())
    for name, raw in _raws().items():  # repeat 0 again on another machine, one record unnamed
        if raw["repeat"] == 0:
            records.write_raw(folder, name, {**raw, "machine": intel}
                              if raw["system"] == "planaria" else raw)
    [written] = mk.rescore()
    cpu = json.loads(written.read_text())["machine"]["cpu"]
    assert cpu.startswith("several: ") and "AMD EPYC" in cpu and "Intel" in cpu
    assert "unrecorded" in cpu
    page = mk.render(mk.load_results())
    line = next(ln for ln in page.splitlines() if ln.startswith("Runs by the machine"))
    assert "Intel(R) Xeon(R) Processor: " in line and "AMD EPYC: " in line
    assert "unrecorded: " in line


def test_a_tagged_recovery_result_gets_its_own_section_beside_the_benchs():
    results = {"recovery": {}, "recovery-torchft-hb50": {}, "recovery-c0ffee": {},
               "overhead": {}}
    order = mk._order(results)
    assert order.index("recovery-c0ffee") == order.index("recovery") + 1


def test_a_transfer_beside_the_step_is_timed_with_its_rest():
    """Beside the step the record times the model's part alone: the throughput adds the
    joiner's rest (``state_received``); a transfer the survivors waited for keeps its own."""
    from bench.planaria_side import _transfer_gb_per_s

    beside = {"event": "state_transfer", "beside": True, "bytes": 10**9, "seconds": 0.2,
              "t": 10.0, "gb_per_s": None}
    events = [beside, {"event": "state_received", "ok": True, "rest_s": 0.3, "t": 11.0}]
    assert _transfer_gb_per_s(beside, events) == pytest.approx(2.0)
    assert _transfer_gb_per_s(beside, events[:1]) is None  # its rest never arrived
    waited = {**beside, "beside": False, "gb_per_s": 5.0}
    assert _transfer_gb_per_s(waited, [waited]) == 5.0


def test_a_system_alone_gets_no_ratio_rows():
    """planaria with a spare run alone: its rows and targets, no planaria row and no ratio
    (no peer ran beside it)."""
    rec = json.loads((REPO / "bench/results/goodput-realistic-spares.json").read_text())
    page = "\n".join(mk.render_goodput_repeats(rec, "goodput-realistic-spares"))
    assert "| planaria, 1 spare (not charged) | — | 0.955 (0.953 to 0.956) |" in page
    assert "| planaria | no spare |" not in page and "÷ best peer" not in page
    assert "| planaria, 1 spare: goodput_ge_0.985 | — | **missed** |" in page
