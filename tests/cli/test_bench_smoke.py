"""Smoke runs of the benchmark scripts (``--quick``: tiny model, few steps).

Each script must print, as its last line, one JSON object with the figures
BENCHMARKS.md is built from. Real processes: Ray workers, torchrun, torchft.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[2]


def run_quick(script: str, tmp_path: Path, timeout_s: float) -> dict:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--quick", f"--workdir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1]
    return json.loads(last)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_overhead_quick(tmp_path):
    out = run_quick("overhead.py", tmp_path, timeout_s=280)

    assert out["bench"] == "overhead"
    for key in ("planaria_step_ms", "ddp_step_ms", "ratio", "controller_overhead_ms"):
        assert isinstance(out[key], float), key
    assert out["planaria_step_ms"] > 0 and out["ddp_step_ms"] > 0
    # the estimator: the median of the rounds' paired ratios, for both pairs of runs
    assert out["ratio"] == pytest.approx(statistics.median(r["ratio"] for r in out["rounds"]))
    assert set(out["pairs"]) == {"like_for_like", "inline"} and out["commit"]


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_recovery_quick(tmp_path):
    out = run_quick("recovery.py", tmp_path, timeout_s=580)

    assert out["bench"] == "recovery"
    pl = out["planaria"]
    for key in ("recover_s", "back_s", "lost_steps", "join_s", "transfer_gb_per_s"):
        assert key in pl, key
    assert pl["lost_steps"] == 0 and pl["recover_s"] > 0
    for system in ("torchrun", "torchft"):
        assert {"recover_s", "back_s", "lost_steps"} <= out[system].keys(), system
    # torchft runs at the goodput bench's configuration, and says which.
    sys.path.insert(0, str(REPO))
    from bench.baselines.torchft_config import load_best

    assert out["torchft"]["config"] == load_best().as_dict()
    assert "speedup_vs_torchrun" in out and "speedup_vs_torchft" in out
    scaling = out["scaling"]  # recovery against state size and replica count (quick: tiny x 2)
    row = scaling["by_size"]["tiny"]
    assert row["full_width_s"] >= row["back_s"] > 0 and row["lost_steps"] == 0
    assert scaling["by_replicas"]["2"]["transfer_bytes"] > 0


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_checkpoint_quick(tmp_path):
    out = run_quick("checkpoint.py", tmp_path, timeout_s=580)

    assert out["bench"] == "checkpoint"
    for key in ("extra_wall_per_ckpt_s", "sync_save_s", "dcp_async_extra_wall_s",
                "torch_save_s", "stall_ratio", "restore_vs_raw", "state_mb", "stall_s"):
        assert isinstance(out[key], float), key
    assert out["sync_save_s"] > 0 and out["restore_vs_raw"] > 0
    assert out["stall_ratio"] == pytest.approx(
        out["extra_wall_per_ckpt_s"] / out["sync_save_s"], rel=1e-2, abs=1e-3)
    assert isinstance(out["page_cache_dropped"], bool)
    pl = out["planaria"]  # the restore against the reads at its parallelism, and one read
    assert pl["restore_vs_raw"]["median"] > 0 and pl["restore_vs_one_read"]["median"] > 0
    assert pl["share"]["restore_vs_raw"]["median"] > 0


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_sharded_bench_quick(tmp_path):
    out = run_quick("sharded.py", tmp_path, timeout_s=1180)

    assert out["bench"] == "sharded"
    assert out["quick"] is True
    assert out["state_bytes_per_worker"].keys() == {"1", "2", "4"}
    assert all(b > 0 for b in out["state_bytes_per_worker"].values())
    assert out["state_ratio"].keys() == {"2", "4"}
    assert out["state_ratio"]["4"] < out["state_ratio"]["2"] < 1
    for key in ("step_ms", "torchrun_hsdp_step_ms", "ratio", "recover_s",
                "back_at_full_width_s"):
        assert isinstance(out[key], float) and out[key] > 0, key
    assert out["ratio"] == pytest.approx(out["step_ms"] / out["torchrun_hsdp_step_ms"])
    assert out["back_at_full_width_s"] >= out["recover_s"]
    assert out["recovery"]["lost_steps"] == 0
    for key in ("dim", "layers", "global_batch", "micro_batch", "rounds"):
        assert isinstance(out[key], int), key


# The goodput-issue benches: opt-in (-m soak) to keep the default suite's time bounded.
@pytest.mark.soak
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_spares_quick(tmp_path):
    out = run_quick("spares.py", tmp_path, timeout_s=580)

    assert out["bench"] == "spares"
    assert out["full_width_s_spare"] > 0 and out["full_width_s_no_spare"] > 0
    assert out["details"]["spares_taken_spare"] == 1
    assert out["details"]["spares_taken_no_spare"] == 0


@pytest.mark.soak
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_overlap_quick(tmp_path):
    out = run_quick("overlap.py", tmp_path, timeout_s=580)

    assert out["bench"] == "overlap"
    assert out["step_ms_overlap"] > 0 and out["step_ms_plain"] > 0
    assert out["overlap_over_plain"] == pytest.approx(
        out["step_ms_overlap"] / out["step_ms_plain"], rel=1e-3)


@pytest.mark.soak
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_warm_join_quick(tmp_path):
    out = run_quick("warm_join.py", tmp_path, timeout_s=880)

    assert out["bench"] == "warm_join"
    assert out["warm_join_s"] > 0 and out["cold_join_s"] > 0
    assert out["details"]["warm"]["replacement"]["compile_s"] < \
        out["details"]["cold"]["replacement"]["compile_s"]


GOODPUT_FIGURES = {"goodput", "useful_steps", "steps_committed", "lost_steps", "recoveries",
                   "kills", "mttr_s_p50", "mttr_s_p99", "full_width_s_p50", "full_width_s_p99",
                   "step_ms"}


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_goodput_quick(tmp_path):
    pytest.importorskip("torchft")
    out = run_quick("goodput.py", tmp_path, timeout_s=880)

    assert out["bench"] == "goodput" and out["regime"] == "quick"
    # planaria's headline (no spare, fixed before the runs) and its spare variant beside;
    # the peers are the other systems only.
    for variant in ("planaria", "planaria_spares"):
        sp = out[variant]
        assert {"goodput", "floor", "samples_per_s", "lost_work_per_kill_steps"} <= sp.keys()
        assert sp["goodput"] > 0 and sp["samples_per_s"] > 0
    assert out["peers"].keys() == {"torchft", "torchrun"}
    for key in ("ratio_goodput_vs_best_peer", "ratio_samples_per_s_vs_best_peer"):
        assert out[key]["median"] is not None and len(out[key]["ci95"]) == 2, key
    saved = json.loads((tmp_path / "goodput-quick.json").read_text())["result"]
    runs = saved["detail"]["runs"]
    for system in ("planaria", "planaria_spares", "torchft", "torchrun"):
        for figures in runs[system]["0"].values():
            assert figures.keys() >= GOODPUT_FIGURES, system
            assert figures["kills"] >= 1 and figures["useful_steps"] > 0, system
            if system.startswith("planaria"):
                assert figures["lost_steps"] == 0
    assert runs["planaria_spares"]["0"]["planaria_spares"]["report"]["spares_taken"] >= 1

    # The raw records are kept: the result comes back from them alone, the same.
    again = subprocess.run(
        [sys.executable, str(REPO / "bench" / "goodput.py"), "--quick", "--rescore",
         f"--workdir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1]) == out


def test_goodput_rescore_names_what_is_missing(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "goodput.py"), "--quick", "--rescore",
         f"--workdir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no raw records" in proc.stderr and "finished run" in proc.stderr


def test_make_benchmarks_md_renders(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO))
    from bench import make_benchmarks_md as mk

    monkeypatch.setattr(mk, "RESULTS", tmp_path)
    side = {"recover_s": 1.0, "back_s": 2.0, "lost_steps": 3, "step_ms": 100.0}
    line = json.dumps(
        {
            "bench": "recovery",
            "planaria": {
                **side,
                "lost_steps": 0,
                "join_s": 0.1,
                "transfer_gb_per_s": 1.5,
                "transfer_bytes": 132e6,
                "transfer_size": "large",
            },
            "torchrun": {**side, "ckpt_every": 20},
            "torchft": side,
            "speedup_vs_torchrun": 10.0,
            "speedup_vs_torchft": 4.0,
        }
    )
    mk.save("recovery", mk.last_json("table\n" + line + "\n"), "python bench/recovery.py")
    text = mk.render(mk.load_results())
    assert "python bench/recovery.py" in text and "| torchrun |" in text
    assert "nproc" not in text and "CPUs" in text
    def est(median: float, lo: float, hi: float) -> dict[str, object]:
        return {"median": median, "ci95": [lo, hi], "n": 3}

    side = {"extra_wall_per_save_s": est(0.2, 0.1, 0.3),
            "blocking_per_save_s": est(0.1, 0.09, 0.12),
            "cold_restore_s": est(1.0, 0.9, 1.1), "restore_vs_raw": est(0.8, 0.75, 0.85)}
    ckpt = {"bench": "checkpoint", "size": "state_1gb", "state_bytes": 907_000_000,
            "replicas": 3, "cpus": 2, "every": 4, "saves_per_run": 3, "repeat": 3,
            "planaria": {**side, "copy_per_save_s": est(0.08, 0.07, 0.09)},
            "dcp": {**side, "config": "thread_cached",
                    "sweep": {"thread_cached": {k: side[k] for k in (
                        "extra_wall_per_save_s", "blocking_per_save_s")}}},
            "memcpy_share_s": est(0.05, 0.04, 0.06),
            "ratios": {"extra_wall_dcp_over_planaria": est(1.2, 1.05, 1.4),
                       "planaria_blocking_over_memcpy": est(2.0, 1.8, 2.4)},
            "targets": {"extra_wall_le_dcp": True, "blocking_le_1_5_memcpy": False,
                        "restore_ge_0_7_raw": True},
            "page_cache_dropped": False, "cold_method": "drop_caches",
            "planaria_saves_dropped": 0}
    mk.save("checkpoint", ckpt, "python bench/checkpoint.py")
    text = mk.render(mk.load_results())
    assert ("| training blocked per save (s) | 0.100 (0.090 to 0.120) | 0.100 (0.090 to "
            "0.120) | planaria / memcpy 2.00 (1.80 to 2.40) | high end ≤ 1.5: **missed** |"
            in text)
    assert "DCP / planaria 1.20 (1.05 to 1.40) | low end > 1: met |" in text
    assert "| `thread_cached` | 0.200 (0.100 to 0.300) |" in text
    assert "served it from a host cache" in text
    assert "| restore vs those reads, cold | 0.800 (0.750 to 0.850) |" in text
    assert "restore vs one read" not in text  # a record from before the bracketed reads
    ckpt["planaria"] |= {"restore_vs_one_read": est(0.6, 0.5, 0.7),
                         "share": {"restore_vs_raw": est(0.9, 0.8, 1.0)}}
    mk.save("checkpoint", ckpt, "python bench/checkpoint.py")
    text = mk.render(mk.load_results())
    assert "| cold plain reads of the same bytes (every replica reading everything) (s)" in text
    assert "| restore vs one read of the checkpoint, cold | 0.600 (0.500 to 0.700) |" in text
    assert "| planaria's `share` restore vs one read, cold | 0.900 (0.800 to 1.000) |" in text


def test_make_benchmarks_md_renders_the_gpu_bench_by_driver(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO))
    from bench import make_benchmarks_md as mk

    monkeypatch.setattr(mk, "RESULTS", tmp_path)
    machine = {"nproc": 16, "mem_gib": 128, "ray": "2.60.0"}
    rec = {"bench": "gpu", "device": "NVIDIA H200", "gpus": 1, "torch": "2.11.0",
           "overhead": {"small": {"planaria_step_ms": 14.48, "ddp_step_ms": 10.01,
                                  "ratio": 1.446, "backend": "gloo"}},
           "recovery": {"size": "large", "backend": "gloo", "back_s": 0.14}}
    mk.save("gpu", rec, "bash bench/gpu_check.sh", machine_info=machine)
    text = mk.render(mk.load_results())
    assert ("| small | one step at a time | 14.48 | 10.01 | 1.446 | gloo | not measured on "
            "this driver |") in text
    assert "re-run `bash bench/gpu_check.sh` on a GPU" in text
    rec["overhead"]["small"] |= {"driver": "run_steps", "ratio": 1.04,
                                 "ratio_ci95": [1.01, 1.07], "le_1_05": False}
    mk.save("gpu", rec, "bash bench/gpu_check.sh", machine_info=machine)
    text = mk.render(mk.load_results())
    assert "| small | autonomous loop | 14.48 | 10.01 | 1.040 [1.010, 1.070] | gloo | " \
        "**missed** |" in text
    assert "re-run `bash bench/gpu_check.sh`" not in text


def test_make_benchmarks_md_renders_goodput(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO))
    from bench import make_benchmarks_md as mk

    monkeypatch.setattr(mk, "RESULTS", tmp_path)
    assert "Goodput under repeated faults" not in mk.render(mk.load_results())
    side = {key: 1.0 for key in GOODPUT_FIGURES} | {"step_ms_by_width": {"2": 90.0, "3": 100.0}}
    out = {"bench": "goodput", "planaria": side, "planaria_spares": {**side, "goodput": 0.97},
           "torchft": {**side, "heartbeat_ms": 500, "pg_timeout_s": 2.0,
                       "sweep": {"250": {"goodput": 0.8}, "500": {"goodput": 0.9}}},
           "torchrun": {**side, "goodput": 0.5, "ckpt_every": 10, "sweep": {"10": side}},
           "goodput_vs_torchft": 0.97, "goodput_vs_torchrun": 1.94, "size": "medium",
           "replicas": 3, "duration_s": 600.0, "kill_every_s": 30.0, "seed": 0, "nproc": 2,
           "targets": {"goodput_spares_min": 0.95}}
    mk.save("goodput", out, "python bench/goodput.py")
    text = mk.render(mk.load_results())
    assert "## Goodput under repeated faults" in text
    assert "| planaria with a spare, goodput | 0.970 | one | ≥ 0.95 | met |" in text
    assert "| ÷ torchft's best | 0.970 | one | > 1 | **missed** |" in text
    assert "| planaria with a spare, full width p50 (s) | 1.00 | one | ≤ 1 | met |" in text
    assert "heartbeat 250 ms: goodput 0.800" in text

    # Three runs: the table is the median run by the ratio to torchft, and every target figure
    # is its own median over the runs (here the median run's goodput is not the median).
    outputs = []
    for i, (good, vs_ft, vs_tr) in enumerate(((0.99, 1.02, 1.1), (0.96, 1.01, 1.3),
                                             (0.98, 0.99, 1.2))):
        run = {**out, "planaria_spares": {**side, "goodput": good, "full_width_s_p50": 0.2 + i},
               "goodput_vs_torchft": vs_ft, "goodput_vs_torchrun": vs_tr}
        path = tmp_path / f"run{i}.out"
        path.write_text("table line\n" + json.dumps(run) + "\n")
        outputs.append(str(path))
    mk.main(["--ingest", "goodput=" + ",".join(outputs), "--out", str(tmp_path / "B.md")])
    saved = json.loads((tmp_path / "goodput.json").read_text())["result"]
    assert saved["goodput_vs_torchft"] == 1.01 and saved["repeats"] == [1.02, 1.01, 0.99]
    assert saved["medians"]["planaria_spares.goodput"] == {"runs": [0.99, 0.96, 0.98],
                                                           "median": 0.98}
    text = (tmp_path / "B.md").read_text()
    assert "| planaria with a spare, goodput | 0.980 | 0.990, 0.960, 0.980 | ≥ 0.95 | met |" in text
    assert "| ÷ torchrun's best | 1.200 | 1.100, 1.300, 1.200 | > 1 | met |" in text
    assert ("| planaria with a spare, full width p50 (s) | 1.20 | 0.20, 1.20, 2.20 | ≤ 1 "
            "| **missed** |") in text


def _synthetic_run(step_ms, kills: list[float], span_s: float = 120.0,
                   recovery_s: float = 0.2) -> tuple[dict, float]:
    """Commits of a system whose fault-free step at time t takes ``step_ms(t, i)`` seconds
    and whose every kill costs ``recovery_s`` of nothing; returns the run and its true
    goodput: the fault-free time of the steps made, over the window."""
    commits, wall, step, needed = [], 0.0, 0, 0.0
    while True:
        ms = step_ms(wall, step)
        recovering = any(k <= wall < k + recovery_s for k in kills)
        wall += recovery_s if recovering else ms
        if wall > span_s:
            break
        step += 1
        needed += ms
        commits.append({"step": step, "wall": wall, "width": 3, "started": wall - ms})
    return ({"t0": 0.0, "t1": span_s, "commits": commits,
             "kills": [{"t_kill": k, "worker": "w1"} for k in kills]}, needed / span_s)


def test_goodput_follows_a_machine_that_speeds_up():
    """A machine that speeds up after the first kill (30 ms steps, then 27 ms) must not read
    as a goodput above 1 (as a baseline from the first 30 s did), nor far below the truth
    (as one baseline for the whole window does): each stretch between kills has its own."""
    from bench import goodput

    run, truth = _synthetic_run(lambda t, i: 0.030 if t < 30.0 else 0.027, [30.0, 60.0, 90.0])
    figures = goodput.window_figures(run, 3)
    assert truth == pytest.approx(0.9957, abs=0.001)
    assert figures["goodput"] == pytest.approx(truth, abs=0.001)
    assert figures["goodput"] <= 1.0


def test_goodput_of_a_run_without_faults_is_one():
    """Skewed step times (every 7th step 2.5 x longer, as on an oversubscribed machine):
    n steps take n mean gaps, so a run with no fault reads 1 (the median gap read 0.82)."""
    from bench import goodput

    run, truth = _synthetic_run(lambda t, i: 0.075 if i % 7 == 0 else 0.030, [])
    figures = goodput.window_figures(run, 3)
    assert truth == pytest.approx(1.0, abs=0.001)
    assert figures["goodput"] == pytest.approx(1.0, abs=0.001)
    assert figures["step_ms"] == pytest.approx(1000 * (6 * 0.030 + 0.075) / 7, rel=0.01)


def test_goodput_under_drift_and_skew_stays_near_the_truth():
    """Steps slowing by 2 % over two minutes (~5 x the drift seen over ten minutes here),
    skewed, a kill every 20 s. (A stretch's step time comes from its part after the
    settling time, later than its middle: under a drift that reads high by about half the
    settling time x the drift rate, 0.0006 here.)"""
    from bench import goodput

    def step_ms(t: float, i: int) -> float:
        return (0.027 + 0.00054 * t / 120.0) * (2.0 if i % 9 == 0 else 1.0)

    kills = [20.0 * k for k in range(1, 6)]
    run, truth = _synthetic_run(step_ms, kills, recovery_s=0.5)
    figures = goodput.window_figures(run, 3)
    assert figures["kills"] == 5
    assert figures["goodput"] == pytest.approx(truth, abs=0.001)
