"""The fault campaign: its schedule, its oracle, its injection machinery, and a real campaign."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from planaria.checkpoint.storage import Storage
from planaria.data.plan import DataPlan
from planaria.faults.campaign import KINDS, MixConfig, oracle, plan_campaign, storage_faults
from planaria.faults.campaign.knobs import CampaignLoss, arm_trigger
from planaria.faults.campaign.mix import (
    COMPOUND_KINDS,
    FINAL_KINDS,
    SAVING_KINDS,
    WHOLE_JOB_KINDS,
    PlannedFault,
    PlannedRun,
    RunShape,
)
from planaria.faults.campaign.runner import SUMMARY_KEYS, CampaignConfig, run_campaign
from planaria.faults.errors import ConfigError

# ---- the schedule ----------------------------------------------------------------------------


def test_schedule_is_seeded_and_deterministic():
    a = plan_campaign(MixConfig(faults=40, seed=7))
    assert a == plan_campaign(MixConfig(faults=40, seed=7))
    assert a != plan_campaign(MixConfig(faults=40, seed=8))
    assert [PlannedRun.from_json(json.loads(json.dumps(r.to_json()))) for r in a] == a


def test_schedule_covers_the_mix_and_every_step_length():
    config = MixConfig(faults=2 * len(KINDS), seed=1)
    runs = plan_campaign(config)
    kinds = [f.kind for r in runs for f in r.faults]
    assert sorted(kinds) == sorted(KINDS * 2)
    assert {r.step_s for r in runs} == set(config.step_lengths)
    for run in runs:
        assert len(run.faults) <= config.faults_per_run[1]
        stepped = [f for f in run.faults if f.kind not in FINAL_KINDS]
        lead = config.lead(run.shape.checkpoint_every)
        assert [f.step for f in stepped] == [lead + i * config.gap for i in range(len(stepped))]
        assert lead >= 5  # two checkpoints before a rollback
        assert run.steps > stepped[-1].step + config.tail if stepped else True
        assert run.steps >= config.min_steps  # every run crosses an epoch boundary
        names = [f.kind for f in run.faults]
        assert sum(k in WHOLE_JOB_KINDS for k in names) <= 1
        # The whole-job fault ends the run's step faults; the final save's comes last.
        assert names == sorted(names, key=lambda k: (k in FINAL_KINDS, k in WHOLE_JOB_KINDS))
        assert all(f.step == run.steps for f in run.faults if f.kind in FINAL_KINDS)
        for f in run.faults:
            assert 0 <= f.micro_batch < config.micro_batches and 0 < f.fraction < 1
            assert 0 <= f.draw < 1
            assert (f.variant in ("joiner", "source")) == (f.kind == "kill_join")
            assert (f.variant in ("shard", "any")) == f.kind.startswith("storage_")
    assert set(kinds) >= COMPOUND_KINDS


def test_each_run_draws_its_configuration_and_what_its_faults_need():
    runs = plan_campaign(MixConfig(faults=300, seed=3))
    shapes = [r.shape for r in runs]
    assert {s.spec for s in shapes} == {"mlp", "bn_mlp", "tiny_gpt"}
    assert {s.replicas for s in shapes} == {2, 3, 4}
    assert {s.checkpoint_every for s in shapes} == {2, 3, 4, "auto"}
    assert any(s.defaults for s in shapes) and any(s.ledger for s in shapes)
    assert any(s.overlap for s in shapes) and any(s.spares for s in shapes)
    sharded = [s for s in shapes if s.workers_per_replica == 2]
    assert sharded and all(s.spec != "bn_mlp" and not s.overlap for s in sharded)
    for run in runs:
        kinds = {f.kind for f in run.faults}
        if "kill_spare" in kinds:
            assert run.shape.spares == 1  # a spare takes the place, a new one warms up
        if "kill_starting" in kinds:
            assert run.shape.spares == 0  # a replacement starts (no spare takes the place)
        workers = run.shape.replicas * run.shape.workers_per_replica
        assert workers <= 8  # every worker runs whole micro-batches of the 8 a step
        if kinds & SAVING_KINDS:  # a save to hit, a checkpoint to roll back to
            assert isinstance(run.shape.checkpoint_every, int) and run.shape.ledger
        for f in run.faults:
            if f.kind in ("bad_sample", "slow_sample"):
                assert f.ahead == 2  # armed before its step's samples are loaded ahead


def test_a_spec_with_few_micro_batches_draws_no_more_workers_than_it_has():
    runs = plan_campaign(MixConfig(faults=60, seed=2, specs=("x.py",), shardable=("x.py",),
                                   step_micro_batches=4, sharded_share=0.5))
    assert {r.shape.replicas for r in runs} <= {2, 3, 4}
    assert all(r.shape.replicas * r.shape.workers_per_replica <= 4 for r in runs)
    assert any(r.shape.workers_per_replica == 2 for r in runs)


def test_slow_loads_and_heavy_micro_batches_outlast_the_step_deadline():
    from planaria.faults.campaign.inject import busy_s

    fault = PlannedFault(index=0, kind="heavy_microbatch", step=7, target=0, micro_batch=0,
                         fraction=0.5, draw=0.0)
    assert busy_s(fault, 0.05) == 8.0  # past the deadline's 5 s floor
    assert busy_s(fault, 2.0, 8.0) == 11.0  # past 4 x the slowest step
    assert busy_s(fault, 0.5, 26.0) == 29.0  # an earlier slow step raised the deadline
    assert busy_s(dataclasses.replace(fault, draw=0.99), 10.0, 40.0) > 75.0


@pytest.mark.parametrize(
    ("field", "value"),
    [("faults", -1), ("kinds", ("kill", "meteor")), ("step_lengths", (0.0,)),
     ("faults_per_run", (4, 2)), ("gap", 1), ("intervals", (0,)), ("replicas", (1, 3)),
     ("spares_share", 1.5)],
)
def test_mix_config_names_the_wrong_field(field, value):
    with pytest.raises(ConfigError, match=field):
        MixConfig(**{"faults": 3, field: value})


# ---- the oracle (each check must be able to fail) -------------------------------------------


def _ledger(plan: DataPlan, steps: int) -> dict[int, list[int]]:
    return {s: [int(i) for i in plan.batch(s)] for s in range(steps)}


def test_exactly_once_counts_duplicated_and_missing_samples():
    plan = DataPlan(100, 16, seed=0)
    good = _ledger(plan, 12)  # crosses an epoch boundary
    assert oracle.exactly_once(good, plan, 12).ok
    dup = {**good, 3: [*good[3], good[3][0]]}
    assert (oracle.exactly_once(dup, plan, 12).duplicated, oracle.exactly_once(dup, plan, 12)
            .missing) == (1, 0)
    lost = {**good, 5: good[5][1:]}
    assert oracle.exactly_once(lost, plan, 12).missing == 1
    swapped = {**good, 7: [*good[7][:-1], good[8][0]]}  # one sample of the next step instead
    once = oracle.exactly_once(swapped, plan, 12)
    assert (once.duplicated, once.missing) == (1, 1)
    gone = {s: v for s, v in good.items() if s != 4}
    assert oracle.exactly_once(gone, plan, 12).missing == 16
    assert oracle.exactly_once({**good, 12: good[0]}, plan, 12).duplicated == 16


def test_weights_differ_catches_a_diverged_tensor():
    ref = {"a": torch.ones(3, 3), "b": torch.zeros(4)}
    assert oracle.weights_differ(ref, {k: v.clone() for k, v in ref.items()}) is None
    assert oracle.weights_differ(ref, {"a": ref["a"] + 1e-7, "b": ref["b"]}) is None
    bad = {"a": ref["a"].clone(), "b": ref["b"] + 1e-2}
    assert "b" in (oracle.weights_differ(ref, bad) or "")
    assert oracle.weights_differ(ref, {"a": ref["a"]}) is not None


def _ev(event: str, **fields) -> dict:
    return {"t": 0.0, "event": event, **fields}


def test_healthy_evicted_names_the_workers_the_campaign_did_not_fault():
    events = [
        _ev("run_start"),
        _ev("generation", workers=["w0", "w1", "w2"]),
        _ev("fault", worker="w1", kind="worker_lost"),
        _ev("generation", workers=["w0", "w2"]),
        _ev("hang_stack", worker="w2"),
        _ev("generation", workers=["w0", "w3"]),
        _ev("run_start"),  # a resume: names start over
        _ev("generation", workers=["w0", "w1", "w2"]),
        _ev("generation", workers=["w0", "w2"]),
    ]
    assert oracle.healthy_evicted(events, {0: {"w1", "w2"}, 1: {"w1"}}) == []
    assert oracle.healthy_evicted(events, {0: {"w1"}, 1: {"w1"}}) == [(0, "w2")]
    assert oracle.healthy_evicted(events, {0: {"w1", "w2"}}) == [(1, "w1")]
    over = [_ev("run_start"), _ev("generation", workers=["w4", "w5"], reason="restore"),
            _ev("generation", workers=["w6", "w7"], reason="restore"),
            _ev("restore", step=0, path=None, lost_steps=13)]
    assert oracle.healthy_evicted(over, {}) == []  # a start over replaces every member


# ---- the injection machinery -----------------------------------------------------------------


@pytest.mark.parametrize("op", ["read", "write"])
def test_faulty_storage_fails_once_when_armed(tmp_path, op):
    control = tmp_path / "control"
    control.mkdir()
    st = Storage(f"faulty://{tmp_path}/root", {"control": str(control)})
    assert not st.local  # every open goes through fsspec, so through the fault
    st.makedirs(st.path("d"))
    st.write_bytes(st.path("d", "x"), b"data")
    storage_faults.arm(control, op, fault_id="f1")
    with pytest.raises(OSError, match=f"injected storage error on {op}"):
        if op == "read":
            st.read_bytes(st.path("d", "x"))
        else:
            st.write_bytes(st.path("d", "x"), b"other")
    assert st.read_bytes(st.path("d", "x")) == b"data"  # once only
    assert [(r["id"], r["action"]) for r in storage_faults.fired(control)] == [
        ("f1", f"storage_{op}")
    ]
    assert st.listdir(st.path("d")) == ["x"]
    storage_faults.arm(control, op, fault_id="f2", match=".safetensors")
    st.write_bytes(st.path("d", "y"), b"not matched")
    assert st.read_bytes(st.path("d", "y")) == b"not matched"
    assert len(storage_faults.fired(control)) == 1
    storage_faults.arm(control, op, fault_id="f3", skip_pid=os.getpid())
    st.write_bytes(st.path("d", "z"), b"not in this process")
    assert st.read_bytes(st.path("d", "z")) == b"not in this process"
    st.remove_tree(st.path("d"))
    assert st.listdir() == []


@pytest.mark.parametrize("op", ["read", "write"])
def test_faulty_storage_errors_armed_back_to_back_both_fire_in_order(tmp_path, op):
    # A campaign run armed two write errors 0.12 s apart; the second replaced the first,
    # which never fired (one of 1,000 faults lost). Each waits its turn now.
    control = tmp_path / "control"
    control.mkdir()
    st = Storage(f"faulty://{tmp_path}/root", {"control": str(control)})
    st.write_bytes(st.path("x"), b"data")
    storage_faults.arm(control, op, fault_id="first")
    storage_faults.arm(control, op, fault_id="second")
    assert storage_faults.armed(control, op) == ["first", "second"]
    for _ in range(2):
        with pytest.raises(OSError, match="injected storage error"):
            if op == "read":
                st.read_bytes(st.path("x"))
            else:
                st.write_bytes(st.path("x"), b"other")
    assert st.read_bytes(st.path("x")) == b"data"
    assert [r["id"] for r in storage_faults.fired(control)] == ["first", "second"]
    assert storage_faults.armed(control, op) == []


def test_faulty_storage_fills_a_disk_part_way_through_a_write_until_freed(tmp_path):
    import errno

    control = tmp_path / "control"
    control.mkdir()
    st = Storage(f"faulty://{tmp_path}/root", {"control": str(control)})
    st.write_bytes(st.path("a"), b"x" * 100)
    storage_faults.fill(control, fault_id="full", fraction=0.25)
    for _ in range(2):  # every write fails while the disk is full, part of its bytes written
        with pytest.raises(OSError) as err:
            st.write_bytes(st.path("b"), b"y" * 100)
        assert err.value.errno == errno.ENOSPC
    assert (tmp_path / "root" / "b").read_bytes() == b"y" * 25
    assert [r["id"] for r in storage_faults.fired(control)] == ["full", "full"]
    storage_faults.free(control)
    st.write_bytes(st.path("b"), b"z" * 100)
    assert st.read_bytes(st.path("b")) == b"z" * 100
    # The write record holds the files that were written, not those a full disk failed.
    assert [Path(w["path"]).name for w in storage_faults.writes(control)] == ["a", "b"]


def test_faulty_storage_preempts_a_writer_part_way_through_its_shard(tmp_path):
    """``term``: SIGTERM to the writing process after ``fraction`` of the bytes; the write
    goes on (``kill`` does the same with SIGKILL, which no test process survives)."""
    import signal

    control = tmp_path / "control"
    control.mkdir()
    st = Storage(f"faulty://{tmp_path}/root", {"control": str(control)})
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        storage_faults.arm(control, "write", fault_id="t1", match=".safetensors",
                           only_pid=os.getpid() + 1, action="term")
        st.write_bytes(st.path("s.safetensors"), b"q" * 10)  # armed for another process
        assert got == []
        storage_faults.arm(control, "write", fault_id="t2", match=".safetensors",
                           only_pid=os.getpid(), action="term", fraction=0.3)
        st.write_bytes(st.path("s.safetensors"), b"w" * 10)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert got == [signal.SIGTERM]
    assert st.read_bytes(st.path("s.safetensors")) == b"w" * 10
    assert [(r["id"], r["action"]) for r in storage_faults.fired(control)] == [
        ("t2", "term_in_io")]


def test_the_campaign_dataset_records_loads_and_serves_armed_sample_faults(tmp_path):
    from planaria.data.randomness import sample_scope, serve_samples
    from planaria.faults.campaign.dataset import CampaignData, arm_sample, read_loads

    data = CampaignData(lambda: list(range(100)), control=str(tmp_path), limit=20)()
    assert len(data) == 20
    with sample_scope(0, -1, 3):
        assert data[3] == 3  # a worker's setup (step -1): not recorded, never faulted
    assert serve_samples(0, 4, data.__getitem__, [1, 2]) == [1, 2]
    arm_sample(tmp_path, fault_id="bad", sample=7, action="raise", from_step=5)
    arm_sample(tmp_path, fault_id="slow", sample=8, action="sleep", from_step=5, sleep_s=0.2)
    assert serve_samples(0, 4, data.__getitem__, [7, 8]) == [7, 8]  # before its step
    for _ in range(2):  # every time from its step on
        with pytest.raises(OSError, match="sample 7 cannot be read"):
            serve_samples(0, 5, data.__getitem__, [7])
    import time

    t0 = time.monotonic()
    serve_samples(0, 5, data.__getitem__, [8])
    assert time.monotonic() - t0 >= 0.2
    t0 = time.monotonic()
    serve_samples(0, 6, data.__getitem__, [8])  # once only
    assert time.monotonic() - t0 < 0.2
    with sample_scope(0, 5, 7):
        assert data[3] == 3
    loads = sorted((step, i) for _, step, i in read_loads(tmp_path))
    assert loads == [(4, 1), (4, 2), (4, 7), (4, 8), (5, 3), (5, 8), (6, 8)]
    fired = storage_faults.fired(tmp_path)
    assert [(r["id"], r["action"]) for r in fired] == [("bad", "bad_sample"),
                                                        ("slow", "slow_sample")]


def test_loss_triggers_signal_the_processes_they_name_and_burn_the_cpu(tmp_path):
    import subprocess
    import time

    sleeper = subprocess.Popen(["sleep", "60"])
    loss = CampaignLoss(lambda model, batch: torch.tensor(1.0), delay_s=0.0, control=str(tmp_path))
    arm_trigger(tmp_path, os.getpid(), fault_id="k", action="kill_pids", micro_batch=0,
                fraction=0.5, pids=[sleeper.pid])
    loss(None, None)
    assert sleeper.wait(timeout=10) == -9
    arm_trigger(tmp_path, os.getpid(), fault_id="h", action="heavy", micro_batch=0,
                fraction=0.5, seconds=0.3)
    t0 = time.monotonic()
    loss(None, None)
    assert time.monotonic() - t0 >= 0.3
    from planaria.faults.campaign.knobs import _burn

    assert _burn(0.01) >= 8  # it computes (matrix products), it does not sleep
    assert [r["id"] for r in storage_faults.fired(tmp_path)] == ["k", "h"]


def test_loss_trigger_fires_once_on_the_planned_micro_batch(tmp_path):
    loss = CampaignLoss(lambda model, batch: torch.tensor(1.0), delay_s=0.01, control=str(tmp_path))
    assert float(loss(None, None)) == 1.0  # nothing armed
    arm_trigger(tmp_path, os.getpid(), fault_id="n1", action="nan", micro_batch=2, fraction=0.5)
    values = [float(loss(None, None)) for _ in range(5)]
    assert [math.isnan(v) for v in values] == [False, False, True, False, False]
    assert [r["id"] for r in storage_faults.fired(tmp_path)] == ["n1"]
    assert not (tmp_path / f"trigger-{os.getpid()}.json").exists()


def test_loss_wrapper_survives_pickling_without_its_state(tmp_path):
    import pickle

    loss = CampaignLoss(np.negative, delay_s=0.0, control=str(tmp_path))
    loss._calls = 7
    again = pickle.loads(pickle.dumps(loss))
    assert again._calls == 0 and again.control == str(tmp_path)


def test_cli_rejects_a_bad_option(capsys):
    from planaria.cli.main import main

    assert main(["campaign", "x.py", "--faults", "3", "--step-s", "fast"]) == 2
    assert "--step-s" in capsys.readouterr().err


# ---- a real campaign -------------------------------------------------------------------------


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
def test_campaign_of_30_faults_recovers_them_all(tmp_path):
    """Five runs of six faults over the first mix (the twelve kinds before the widened one),
    one of them with 6 s steps (kills there leave survivors computing for seconds), on mlp at
    3 replicas. About 10 minutes on a busy 2-core machine."""
    kinds = KINDS[:12]
    mix = MixConfig(faults=30, seed=5, kinds=kinds, step_lengths=(0.05, 0.5, 6.0),
                    faults_per_run=(6, 6), gap=2, intervals=(2,), tail=2, specs=("mlp",),
                    replicas=(3, 3), sharded_share=0.0, spares_share=0.0, overlap_share=0.0,
                    defaults_share=0.0)
    runs = plan_campaign(mix)
    assert len(runs) == 5 and [r.step_s for r in runs].count(6.0) == 1
    assert {f.kind for r in runs for f in r.faults} == set(kinds)
    lines: list[str] = []
    summary = run_campaign(CampaignConfig(mix=mix, workdir=tmp_path), out=lines.append)
    report = "\n".join(lines) + "\n" + json.dumps(summary)
    assert set(SUMMARY_KEYS) <= set(summary)
    assert summary["faults_injected"] == 30, report
    for key in ("unrecovered", "diverged", "samples_duplicated", "samples_missing",
                "healthy_evicted", "not_injected"):
        assert summary[key] == 0, f"{key}: {summary[key]}\n{report}"
    assert summary["fired_in_runs"] > 0, report  # the autonomous loop users run is exercised


# ---- one run's verdict, on a synthetic run dir -----------------------------------------------

T0 = 1000.0


def _write_events(run_dir: Path, evs: list[dict]) -> None:
    (run_dir / "job").mkdir(parents=True, exist_ok=True)
    (run_dir / "job" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "job" / "events.jsonl").read_text()
            .splitlines()]


def _append(path: Path, *records: dict) -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def _synthetic_run(run_dir: Path, *, report_fault: bool = True, evict_w2: bool = False,
                   kind: str = "kill", ledger: bool = True):
    """A 4-step run where w1 was killed at step 2, as the files the campaign reads: events
    every 0.1 s from T0, the kill fired 0.05 s before its fault record."""
    from safetensors.torch import save_file

    plan = DataPlan(64, 16, seed=0)
    (run_dir / "control").mkdir(parents=True)
    evs = [_ev("run_start", run_id="x", replicas=3, steps=4, global_batch_size=16,
               micro_batch_size=4),
           _ev("generation", gen=0, workers=["w0", "w1", "w2"], reason="start")]
    evs += [_ev("step_committed", step=s, width=3, duration_s=0.1, samples=16) for s in (0, 1)]
    if report_fault:
        evs += [_ev("fault", fault_id=0, kind="worker_lost", worker="w1", step=2),
                _ev("detected", fault_id=0, kind="worker_lost", worker="w1", detect_s=0.1)]
    if evict_w2:
        evs.append(_ev("hang_stack", worker="w2", stack=None))
    evs.append(_ev("generation", gen=1, workers=["w0"] if evict_w2 else ["w0", "w2"],
                   reason="resize"))
    evs += [_ev("step_committed", step=s, width=2, duration_s=0.1, samples=16) for s in (2, 3)]
    evs.append(_ev("run_end", status="ok", step=4))
    for i, e in enumerate(evs):
        e["t"] = T0 + 0.1 * i
    _write_events(run_dir, evs)
    if ledger:
        (run_dir / "job" / "ledger.jsonl").write_text("".join(
            json.dumps({"step": s, "ids": plan.batch(s).tolist()}) + "\n" for s in range(4)))
    (run_dir / "control" / "loads-1.txt").write_text("".join(
        f"{s} {i}\n" for s in range(4) for i in plan.batch(s)))
    (run_dir / "campaign_job.json").write_text(json.dumps(plan.describe()))
    fired_t = T0 + 0.35  # after step 1's commit, before the fault record
    inj = {"fault": 0, "kind": kind, "role": "primary", "action": "kill", "id": "r0f0.primary",
           "worker": "w1", "pid": 1, "step": 2, "incarnation": 0, "t": T0, "victims": ["w1"],
           "expect": ["worker_lost", "all_replicas_lost"]}
    (run_dir / "campaign_faults.jsonl").write_text(json.dumps(inj) + "\n")
    fired = {"id": "r0f0.primary", "action": "kill", "t": fired_t, "pid": 1}
    (run_dir / "control" / "fired.jsonl").write_text(json.dumps(fired) + "\n")
    weights = {"w": torch.arange(4.0)}
    for name in ("w0", "w2"):
        save_file(weights, str(run_dir / f"final-{name}.safetensors"))
    (run_dir / "final.json").write_text(json.dumps({"members": ["w0", "w2"], "steps": 4}))
    fault = PlannedFault(index=0, kind=kind, step=2, target=1, micro_batch=0, fraction=0.5)
    run = PlannedRun(index=0, step_s=0.05, steps=4, faults=(fault,),
                     shape=RunShape(spec="mlp", replicas=3, ledger=ledger))
    return run, (lambda run, run_dir: {4: weights})


def _check(run_dir, run, refs, **kwargs):
    from planaria.faults.campaign.verdict import check_run

    return check_run(run_dir, run, refs, **kwargs)


def _bounds(v) -> dict[str, tuple]:
    return {b.name: (b.value, b.limit, b.ok) for f in v.faults for b in f.bounds} | {
        b.name: (b.value, b.limit, b.ok) for b in v.bounds}


def test_verdict_of_a_recovered_run(tmp_path):
    from planaria.faults.campaign.runner import campaign_ok, summarize_campaign

    run, refs = _synthetic_run(tmp_path)
    v = _check(tmp_path, run, refs)
    assert v.ok, v.reasons
    f = v.faults[0]
    assert f.recovered and not f.tolerated
    # measured from fired.jsonl: 0.05 s to the fault record, 0.35 s to the next commit
    assert f.detect_s == pytest.approx(0.05) and f.recover_s == [pytest.approx(0.35)]
    bounds = _bounds(v)
    assert bounds["detect_0.5s"][2] and bounds["lost_steps"][:2] == (0, 0)
    # detection + one step at width 2 (4 micro-batches: 2 a rank, not 2 of 3) + 1 s of slack
    assert bounds["kill_recovered"][2] and bounds["kill_recovered"][1] < 1.5
    summary = summarize_campaign([v])
    assert (summary["faults_injected"], summary["recovered"], summary["unrecovered"]) == (1, 1, 0)
    assert summary["kinds"]["kill"] == {"injected": 1, "ok": 1, "failed": 0}
    assert set(SUMMARY_KEYS) <= set(summary) and campaign_ok(summary)


def test_a_fault_in_a_run_is_counted_as_such(tmp_path):
    """The kill fired at T0 + 0.35; a run_ahead event whose span covers it marks it in a run."""
    from planaria.faults.campaign.runner import summarize_campaign

    run, refs = _synthetic_run(tmp_path)
    v = _check(tmp_path, run, refs)
    assert v.faults[0].in_run is False
    events = _events(tmp_path)
    ran = _ev("run_ahead", gen=0, start=0, until=4, steps=2, ended="failed", why="worker_lost",
              width=3, committed=2, behind=[], started_t=T0 + 0.2)
    ran["t"] = T0 + 0.45
    events.insert(-1, ran)
    _write_events(tmp_path, events)
    v = _check(tmp_path, run, refs)
    assert v.ok, v.reasons
    assert v.faults[0].in_run is True
    assert summarize_campaign([v])["fired_in_runs"] == 1


def test_verdict_catches_what_went_wrong(tmp_path):
    from safetensors.torch import save_file

    run, refs = _synthetic_run(tmp_path / "a", report_fault=False)
    v = _check(tmp_path / "a", run, refs)
    assert not v.faults[0].recovered and "not in the report" in v.faults[0].reason

    run, refs = _synthetic_run(tmp_path / "b", evict_w2=True)
    v = _check(tmp_path / "b", run, refs)
    assert v.healthy_evicted == ["0:w2"] and any("healthy worker w2" in r for r in v.reasons)

    run, refs = _synthetic_run(tmp_path / "c")  # one member of two diverged: it is named
    save_file({"w": torch.arange(4.0) + 0.5}, str(tmp_path / "c" / "final-w2.safetensors"))
    _append(tmp_path / "c" / "job" / "ledger.jsonl",
            {"step": 3, "ids": [*DataPlan(64, 16, 0).batch(3).tolist(), 0]})
    v = _check(tmp_path / "c", run, refs)
    assert v.diverged and any("w2's final weights differ" in r for r in v.reasons)
    assert (v.duplicated, v.missing) == (1, 0)

    run, refs = _synthetic_run(tmp_path / "d")
    v = _check(tmp_path / "d", run, refs, error="exit code 1: boom")
    assert not v.completed and not v.faults[0].recovered


def test_bounds_are_measured_from_the_injection_and_counted_per_bound(tmp_path):
    """The kill fired 0.8 s before its fault record (detection past 0.5 s); the step in
    flight re-ran a committed step (a lost step while survivors held the state)."""
    from planaria.faults.campaign.runner import campaign_ok, summarize_campaign

    run, refs = _synthetic_run(tmp_path)
    fired = tmp_path / "control" / "fired.jsonl"
    fired.write_text(json.dumps({"id": "r0f0.primary", "action": "kill", "t": T0 - 0.4,
                                 "pid": 1}) + "\n")  # before step 0 committed
    v = _check(tmp_path, run, refs)
    bounds = _bounds(v)
    assert bounds["detect_0.5s"] == (pytest.approx(0.8), 0.5, False)
    assert bounds["kill_recovered"][2]  # its limit counts the (slow) detection in
    summary = summarize_campaign([v])
    assert summary["bound_violations"]["detect_0.5s"] == 1 and not campaign_ok(summary)
    assert summary["kinds"]["kill"]["failed"] == 1
    assert any("bound detect_0.5s" in r for r in v.reasons)

    run, refs = _synthetic_run(tmp_path / "lost")
    events = _events(tmp_path / "lost")
    for e in events:  # the recovery re-ran step 1, committed before the kill
        if e["event"] == "step_committed" and e["width"] == 2:
            e["step"] -= 1
    _write_events(tmp_path / "lost", events)
    v = _check(tmp_path / "lost", run, refs)
    assert _bounds(v)["lost_steps"] == (1, 0, False)
    assert v.faults[0].lost_steps == 1


def test_a_restore_may_lose_only_the_steps_since_the_newest_finished_save(tmp_path):
    """A non-finite step rolls back: with a save of step 1 whose shards were all written
    before it, restoring step 0 loses a step it need not have (the commit came later)."""
    run, refs = _synthetic_run(tmp_path, kind="nonfinite")
    inj = {"fault": 0, "kind": "nonfinite", "role": "primary", "action": "nan",
           "id": "r0f0.primary", "worker": "w1", "pid": 1, "step": 2, "incarnation": 0,
           "t": T0, "victims": [], "expect": ["nonfinite_loss"]}
    (tmp_path / "campaign_faults.jsonl").write_text(json.dumps(inj) + "\n")
    events = _events(tmp_path)
    for e in events:
        if e["event"] in ("fault", "detected"):
            e["kind"], e["worker"] = "nonfinite_loss", None
        if e["event"] == "step_committed" and e["width"] == 2:
            e["step"] -= 2  # restored step 0: steps 0 and 1 again
    _write_events(tmp_path, events)
    root = tmp_path / "checkpoints" / "step_000000001" / "save-abc"
    for i in (1, 2, 3):
        _append(tmp_path / "control" / "writes.jsonl",
                {"path": str(root / f"shard-0000{i}-of-00003.safetensors"), "t": T0 + 0.32,
                 "pid": 5})
    v = _check(tmp_path, run, refs)
    assert _bounds(v)["lost_steps"] == (2, 1, False)


def test_a_commit_is_bounded_from_its_last_writer(tmp_path):
    """checkpoint_saved 0.5 s after the last shard's close through faulty:// (hole: commits
    at the next boundary); with the runtime's writers_done_t, that is used instead."""
    run, refs = _synthetic_run(tmp_path)
    root = tmp_path / "checkpoints" / "step_000000002" / "save-abc"
    for i, t in ((1, T0 + 0.1), (2, T0 + 0.2)):
        _append(tmp_path / "control" / "writes.jsonl",
                {"path": str(root / f"shard-0000{i}-of-00002.safetensors"), "t": t, "pid": 5})
    events = _events(tmp_path)
    saved = _ev("checkpoint_saved", step=2, path="faulty://x/step_000000002", reason="interval",
                save_s=0.6)
    saved["t"] = T0 + 0.7
    _write_events(tmp_path, [*events[:-1], saved, events[-1]])
    v = _check(tmp_path, run, refs)
    assert _bounds(v)["commit_0.2s"] == (pytest.approx(0.5), 0.2, False)
    saved["writers_done_t"] = T0 + 0.6
    _write_events(tmp_path, [*events[:-1], saved, events[-1]])
    v = _check(tmp_path, run, refs)
    assert _bounds(v)["commit_0.2s"] == (pytest.approx(0.1), 0.2, True)


def test_a_run_on_the_users_defaults_is_judged_from_the_datasets_load_record(tmp_path):
    run, refs = _synthetic_run(tmp_path, ledger=False)
    assert _check(tmp_path, run, refs).ok
    plan = DataPlan(64, 16, seed=0)
    lines = (tmp_path / "control" / "loads-1.txt").read_text().splitlines()
    missing = f"2 {plan.batch(2)[3]}"
    kept = [line for line in lines if line != missing] + [f"1 {plan.batch(3)[0]}"]
    (tmp_path / "control" / "loads-1.txt").write_text("\n".join(kept) + "\n")
    v = _check(tmp_path, run, refs)
    assert (v.duplicated, v.missing) == (1, 1)
    assert any("load record" in r for r in v.reasons)


def test_processes_left_behind_fail_the_run(tmp_path):
    run, refs = _synthetic_run(tmp_path)
    _append(tmp_path / "jobs.jsonl", {"incarnation": 0, "rc": 0, "started_t": T0,
                                      "ended_t": T0 + 2, "left": {"4242": "incarnation 0: raylet"}})
    v = _check(tmp_path, run, refs)
    assert v.processes_left == ["4242 (incarnation 0: raylet)"] and not v.ok


def _retarget(run_dir: Path, kind: str, action: str, **extra) -> PlannedRun:
    inj = {"fault": 0, "kind": kind, "role": "primary", "action": action,
           "id": "r0f0.primary", "worker": "w1", "pid": 1, "step": 2, "incarnation": 0,
           "t": T0, "victims": [], "expect": None, **extra}
    (run_dir / "campaign_faults.jsonl").write_text(json.dumps(inj) + "\n")
    fault = PlannedFault(index=0, kind=kind, step=2, target=1, micro_batch=0, fraction=0.5)
    return PlannedRun(index=0, step_s=0.05, steps=4, faults=(fault,),
                      shape=RunShape(spec="mlp", replicas=3))


def _without_fault(run_dir: Path) -> None:
    events = [e for e in _events(run_dir) if e["event"] not in ("fault", "detected")]
    for e in events:
        if e["event"] == "step_committed":
            e["width"] = 3
        if e["event"] == "generation":
            e["workers"] = ["w0", "w1", "w2"]
    _write_events(run_dir, events)


def test_a_bad_sample_is_tolerated_when_skipped_and_no_worker_goes(tmp_path):
    run, refs = _synthetic_run(tmp_path)
    _without_fault(tmp_path)
    sample = int(DataPlan(64, 16, 0).batch(2)[5])
    run = _retarget(tmp_path, "bad_sample", "bad_sample", sample=sample, from_step=2)
    v = _check(tmp_path, run, refs)
    assert v.faults[0].tolerated and not v.faults[0].recovered
    assert "no sample_skipped record names sample" in v.faults[0].reason
    events = _events(tmp_path)
    skipped = _ev("sample_skipped", step=2, sample=sample, error="OSError")
    skipped["t"] = T0 + 0.5
    # The skipped sample is neither loaded nor in the ledger: not missing.
    lines = (tmp_path / "control" / "loads-1.txt").read_text().splitlines()
    (tmp_path / "control" / "loads-1.txt").write_text(
        "\n".join(x for x in lines if x != f"2 {sample}") + "\n")
    _write_events(tmp_path, [*events[:-1], skipped, events[-1]])
    v = _check(tmp_path, run, refs)
    assert v.ok, v.reasons
    from planaria.faults.campaign.runner import summarize_campaign

    summary = summarize_campaign([v])
    assert (summary["tolerated"], summary["recovered"]) == (1, 0)
    lost = _ev("fault", fault_id=0, kind="worker_lost", worker="w1", step=2)
    lost["t"] = T0 + 0.45
    _write_events(tmp_path, [*events[:-1], lost, skipped, events[-1]])
    v = _check(tmp_path, run, refs)
    assert "needed no recovery, yet w1 was reported as worker_lost" in v.faults[0].reason


def test_a_straggler_is_not_blamed_for_the_departure_of_another_faults_victim(tmp_path):
    """w1, a straggler, also got a preemption notice from another fault of the run: its
    drain is that fault's, not the straggler's eviction; a worker_lost of w1 with no other
    fault to own it is."""
    run, refs = _synthetic_run(tmp_path)
    events = _events(tmp_path)
    for e in events:
        if e["event"] in ("fault", "detected"):
            e["kind"] = "preempted"
    _write_events(tmp_path, events)
    slow = {"fault": 0, "kind": "slow", "role": "primary", "action": "slow",
            "id": "r0f0.primary", "worker": "w1", "pid": 1, "step": 2, "incarnation": 0,
            "t": T0}
    notice = {"fault": 1, "kind": "preempt", "role": "primary", "action": "preempt",
              "id": "r0f1.primary", "worker": "w1", "pid": 1, "step": 2, "incarnation": 0,
              "t": T0, "victims": ["w1"], "expect": ["preempted"]}
    (tmp_path / "campaign_faults.jsonl").write_text(json.dumps(slow) + "\n"
                                                     + json.dumps(notice) + "\n")
    _append(tmp_path / "control" / "fired.jsonl",
            {"id": "r0f1.primary", "action": "preempt", "t": T0 + 0.36, "pid": 1})
    faults = (PlannedFault(index=0, kind="slow", step=2, target=1, micro_batch=0, fraction=0.5),
              PlannedFault(index=1, kind="preempt", step=2, target=1, micro_batch=0,
                           fraction=0.5))
    run = dataclasses.replace(run, faults=faults)
    v = _check(tmp_path, run, refs)
    assert v.ok, v.reasons
    assert v.faults[0].tolerated and v.faults[0].recovered
    (tmp_path / "campaign_faults.jsonl").write_text(json.dumps(slow) + "\n")
    v = _check(tmp_path, dataclasses.replace(run, faults=faults[:1]), refs)
    assert "needed no recovery, yet w1 was reported as preempted" in v.faults[0].reason


def test_a_stalled_worker_is_evicted_within_the_step_deadline(tmp_path):
    run, refs = _synthetic_run(tmp_path)
    run = _retarget(tmp_path, "stall", "stall", victims=["w1"], expect=["worker_hung"])
    events = _events(tmp_path)
    for e in events:
        if e["event"] in ("fault", "detected"):
            e["kind"] = "worker_hung"
    _write_events(tmp_path, events)
    v = _check(tmp_path, run, refs)
    assert _bounds(v)["stall_evicted"] == (pytest.approx(0.05), 5.0 + 5.0, True)
    (tmp_path / "control" / "fired.jsonl").write_text(json.dumps(
        {"id": "r0f0.primary", "action": "stall", "t": T0 + 0.35 - 11.0, "pid": 1}) + "\n")
    v = _check(tmp_path, run, refs)
    assert _bounds(v)["stall_evicted"][2] is False


def test_a_fleet_preemption_needs_a_snapshot_within_a_second_and_loses_nothing(tmp_path):
    run, refs = _synthetic_run(tmp_path)
    run = _retarget(tmp_path, "fleet_preempt", "fleet", grace_s=0.1)
    v = _check(tmp_path, run, refs)  # a replica kept the state (nothing restored): no save due
    assert v.faults[0].recovered and "notice_to_snapshot_1s" not in _bounds(v)
    events = _events(tmp_path)
    restore = _ev("restore", step=0, path="faulty://x/step_000000000", reason="restore")
    restore["t"] = T0 + 0.65  # the state left with the fleet: a restore before the commit
    events.insert(-3, restore)
    _write_events(tmp_path, events)
    v = _check(tmp_path, run, refs)
    assert _bounds(v)["notice_to_snapshot_1s"] == (None, 1.0, False)
    assert "no save of the step in hand (2)" in v.faults[0].reason
    started = _ev("checkpoint_started", step=2, save_id="s", reason="preemption")
    saved = _ev("checkpoint_saved", step=2, path="faulty://x/step_000000002", reason="preemption",
                save_s=0.1)
    started["t"], saved["t"] = T0 + 0.37, T0 + 0.38
    _write_events(tmp_path, [*events[:4], started, saved, *events[4:]])
    v = _check(tmp_path, run, refs)
    assert _bounds(v)["notice_to_snapshot_1s"] == (pytest.approx(0.02), 1.0, True)
    assert _bounds(v)["lost_steps"] == (0, 0, True) and v.faults[0].recovered, v.reasons


def test_the_injector_names_the_boundaries_it_needs(tmp_path):
    """The job runs autonomously between them; a fault armed ``ahead`` steps early fires
    inside the run."""
    from control_fakes import FakeRoster, handle
    from planaria.control.boundary import BoundaryPlanner
    from planaria.control.hooks import FaultHooks
    from planaria.faults.campaign.inject import Injector
    from planaria.faults.campaign.mix import PlannedFault, PlannedRun
    from planaria.faults.campaign.triggers import STALE_STEPS

    faults = (PlannedFault(index=0, kind="kill", step=8, target=1, micro_batch=0, fraction=0.5,
                           ahead=2),
              PlannedFault(index=1, kind="hang", step=11, target=1, micro_batch=1, fraction=0.5))
    inj = Injector(PlannedRun(index=0, step_s=0.05, steps=16, faults=faults), run_dir=tmp_path,
                   control=tmp_path, job_dir=tmp_path, incarnation=0)
    assert inj.next_step(0) == 6  # armed two steps before its step
    assert inj.next_step(6) == 7  # late: the next step
    inj.todo.pop(0)
    assert inj.next_step(7) == 11
    inj.triggers.armed["r0f0.primary"] = {"step": 6}  # armed at 6, not fired yet: the next fault
    assert inj.next_step(7) == 6 + STALE_STEPS  # waits (its firing ends the run) or goes stale
    (tmp_path / "fired.jsonl").write_text(json.dumps({"id": "r0f0.primary"}) + "\n")
    assert inj.next_step(7) == 11
    inj.todo.pop(0)
    assert inj.next_step(11) == 13  # the tail: back at full width after the last fault
    inj.tail_step = None
    assert inj.next_step(13) is None

    hooks = FaultHooks(None)
    planner = BoundaryPlanner(
        roster=FakeRoster([handle(f"w{i}") for i in range(3)]), hooks=hooks, checkpoints=None,
        chaos=None, replicas=3, verify_every=None, replacements_ready=lambda: False,
        draining_nodes=None, ray_lost=lambda: False, elapsed_s=lambda: 0.0)

    def next_boundary(start: int, until: int) -> int:
        return planner.next_boundary(start, until, open_work=False, metrics_known=True)

    assert next_boundary(0, 16) == 16
    hooks.hooks.append(Injector(PlannedRun(index=0, step_s=0.05, steps=16, faults=faults),
                                run_dir=tmp_path, control=tmp_path, job_dir=tmp_path,
                                incarnation=0))
    assert next_boundary(0, 16) == 6
    hooks.hooks.append(lambda *a, **k: None)  # a hook that names none needs every boundary
    assert next_boundary(0, 16) == 1


def test_a_resumed_campaign_judges_again_the_runs_it_finished(tmp_path):
    """`--resume` finds a finished run (only the very run it was made for) and the error its
    job ended with, so that the run is judged again from its files, not run again."""
    import dataclasses

    from planaria.faults.campaign.runner import _keep_run, _kept_run
    from planaria.faults.campaign.verdict import RunVerdict, check_run

    run, refs = _synthetic_run(tmp_path)
    v = check_run(tmp_path, run, refs)
    _keep_run(tmp_path, run, None, v)
    assert _kept_run(tmp_path, run) == (None,)
    kept = json.loads((tmp_path / "verdict.json").read_text())
    assert RunVerdict.from_json(kept["verdict"]) == v
    assert _kept_run(tmp_path, dataclasses.replace(run, steps=5)) is None  # another plan
    failed = check_run(tmp_path, run, refs, error="exit code 1: boom")
    _keep_run(tmp_path, run, "exit code 1: boom", failed)
    assert _kept_run(tmp_path, run) == ("exit code 1: boom",)
    (tmp_path / "verdict.json").write_text("{half a fil")
    assert _kept_run(tmp_path, run) is None  # a torn file: the run is run again


def test_a_campaign_in_parts_takes_finished_runs_from_its_record(tmp_path):
    """`--record`: each finished run's line is appended; a later part takes the runs of the
    same plan from it (a line of another plan, or torn by a kill, is not taken)."""
    import dataclasses

    from planaria.faults.campaign.runner import _append_record, _recorded
    from planaria.faults.campaign.verdict import check_run

    run, refs = _synthetic_run(tmp_path)
    v = check_run(tmp_path, run, refs)
    record = tmp_path / "parts" / "record.jsonl"
    assert _recorded(record, [run]) == {}
    _append_record(record, run, None, v)
    other = dataclasses.replace(run, steps=5)
    _append_record(record, other, None, dataclasses.replace(v, index=run.index))
    with record.open("a") as f:
        f.write('{"run": {"index": 1')  # torn
    assert _recorded(record, [run]) == {run.index: v}
    assert _recorded(record, [other]) == {run.index: dataclasses.replace(v, index=run.index)}


def test_a_fault_cut_short_by_the_campaigns_job_kill_is_recovered_by_the_resume(tmp_path):
    """w1 is killed at step 2 and, before a step commits, the whole job is killed; the resumed
    job restores and finishes: the kill is recovered by the resume, not left open."""
    run, refs = _synthetic_run(tmp_path)
    evs = _events(tmp_path)
    cut = [e for e in evs if e["event"] not in ("recovered", "step_committed", "run_end")
           or e.get("step", 0) < 2]
    resumed = [_ev("run_start", run_id="y", replicas=3, steps=4),
               _ev("generation", gen=0, workers=["w0", "w2", "w3"], reason="start"),
               _ev("restore", step=2, reason="resume", lost_steps=0)]
    resumed += [_ev("step_committed", step=s, width=3, duration_s=0.1, samples=16)
                for s in (2, 3)]
    resumed.append(_ev("run_end", status="ok", step=4))
    for i, e in enumerate(resumed):
        e["t"] = T0 + 20 + 0.5 * i
    _write_events(tmp_path, cut + resumed)
    inj = {"fault": 0, "kind": "kill", "role": "primary", "action": "job_kill",
           "id": "r0f0.job", "worker": None, "pid": 1, "step": 2, "incarnation": 0, "t": T0}
    _append(tmp_path / "campaign_faults.jsonl", inj)
    _append(tmp_path / "control" / "fired.jsonl",
            {"id": "r0f0.job", "action": "job_kill", "t": T0 + 5, "pid": 1})
    v = _check(tmp_path, run, refs)
    # from the kill (T0 + 0.35) to the resumed job's first commit (T0 + 21.5)
    assert v.faults[0].recovered and v.faults[0].recover_s == [pytest.approx(21.15)], v.reasons

    (tmp_path / "control" / "fired.jsonl").write_text(  # no resumed job: left open
        (tmp_path / "control" / "fired.jsonl").read_text().splitlines()[0] + "\n")
    _write_events(tmp_path, cut)
    v = _check(tmp_path, run, refs)
    assert not v.faults[0].recovered and "never recovered" in v.faults[0].reason


def test_a_fault_armed_again_on_another_worker_is_judged_where_it_fired(tmp_path):
    """A kill first armed on w2, which left the job (drained) before the trigger's step, is
    armed again on w1 and fires there once (fired.jsonl names w1's pid): the verdict judges
    the kill of w1, not the arming that never fired (found by the 1,000-fault campaign)."""
    run, refs = _synthetic_run(tmp_path)
    faults = tmp_path / "campaign_faults.jsonl"
    first = {"fault": 0, "kind": "kill", "role": "primary", "action": "kill",
             "id": "r0f0.primary", "worker": "w2", "pid": 2, "step": 1, "incarnation": 0,
             "t": 999.0, "victims": ["w2"], "expect": ["worker_lost"]}
    faults.write_text(json.dumps(first) + "\n" + faults.read_text())
    v = _check(tmp_path, run, refs)
    assert v.ok, v.reasons
    assert v.faults[0].recovered


def test_a_kill_of_the_last_replica_is_rightly_all_replicas_lost(tmp_path):
    """A kill that takes the last replica holding the state (an earlier fault took the
    others) is reported as all_replicas_lost, and the job restores: no complaint."""
    run, refs = _synthetic_run(tmp_path)
    events = tmp_path / "job" / "events.jsonl"
    events.write_text(events.read_text().replace('"worker_lost"', '"all_replicas_lost"'))
    v = _check(tmp_path, run, refs)
    assert v.ok, v.reasons
    events.write_text(events.read_text().replace('"all_replicas_lost"', '"worker_hung"'))
    v = _check(tmp_path, run, refs)
    assert any("reported as worker_hung" in r for r in v.reasons)


# ---- the independent reference ---------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "bn_mlp", "tiny_gpt"])
def test_the_plain_loop_reference_equals_a_faultless_planaria_run(tmp_path, name):
    """The campaign's reference (one process, no controller, no collective) trains what
    planaria trains at 3 replicas, past an epoch boundary: BatchNorm's statistics composed
    over the ranks, dropout seeded per micro-batch, the scheduler, the clipping."""
    from planaria.faults.campaign.reference import train_reference
    from planaria.faults.campaign.specs import EPOCH_STEPS, build_spec
    from planaria.fit import fit

    spec = build_spec(name, control=None)
    steps = EPOCH_STEPS + 2
    ref = train_reference(spec, [steps])[steps]
    result = fit(spec, steps=steps, replicas=3, run_dir=tmp_path, threads_per_worker=1)
    assert oracle.weights_differ(ref, result.state_dict) is None


def test_the_reference_leaves_a_skipped_sample_out_from_its_step_on():
    from planaria.faults.campaign.reference import train_reference
    from planaria.faults.campaign.specs import build_spec

    spec = build_spec("mlp", control=None)
    plan = DataPlan(640, 64, spec.seed)
    sample = int(plan.batch(3)[5])
    plain = train_reference(spec, [2, 4])
    skipped = train_reference(spec, [2, 4], skip={sample: 3})
    assert oracle.weights_differ(plain[2], skipped[2]) is None  # before its step: the same
    assert oracle.weights_differ(plain[4], skipped[4]) is not None
    late = train_reference(spec, [4], skip={sample: 4})  # armed after its only appearance
    assert oracle.weights_differ(plain[4], late[4]) is None


def test_a_run_dir_on_a_tmpfs_keeps_its_files_when_unmounted(tmp_path):
    """The run dir a disk_full fault fills is a small tmpfs the campaign mounts (as root);
    its files are kept when it is unmounted. Skipped where mounting is refused."""
    from planaria.faults.campaign.full_disks import is_tmpfs
    from planaria.faults.campaign.knobs import fill_disk
    from planaria.faults.campaign.runner import _mount_tmpfs, _unmount

    job = tmp_path / "job"
    job.mkdir()
    if not _mount_tmpfs(job):
        pytest.skip("mounting a tmpfs is refused here (needs root, or CAP_SYS_ADMIN)")
    try:
        assert is_tmpfs(job)
        (job / "events.jsonl").write_text("{}\n")
        fill_disk(str(job / "ballast"))
        with pytest.raises(OSError):
            (job / "more").write_bytes(b"x" * (1 << 20))
    finally:
        _unmount(job)
    assert not is_tmpfs(job)
    assert (job / "events.jsonl").read_text() == "{}\n"
    assert not (job / "ballast").exists()


def test_a_jobs_own_processes_are_told_from_any_other(tmp_path):
    """Ray's GCS and raylet are found among the controller's own children; a run's processes
    by the marker they inherit (another run's, or none, are not the run's)."""
    import signal
    import subprocess
    import sys

    from planaria.faults.campaign import procs

    raylet = tmp_path / "raylet"
    raylet.symlink_to("/bin/sleep")
    env = {**os.environ, procs.RUN_MARKER: str(tmp_path / "run"), procs.INCARNATION: "1"}
    # A controller of its own (this test process may hold a real Ray's raylet as a child)
    # that starts the "raylet" (Popen returns once it is exec'd) and prints its pid.
    start = ("import subprocess, sys; p = subprocess.Popen([sys.argv[1], '30']); "
             "print(p.pid, flush=True); p.wait()")
    controller = subprocess.Popen([sys.executable, "-c", start, str(raylet)], env=env,
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
    other = subprocess.Popen(["sleep", "30"],
                             env={**os.environ, procs.RUN_MARKER: str(tmp_path / "other")})
    try:
        assert controller.stdout is not None
        mine = int(controller.stdout.readline())
        assert procs.ray_children(controller.pid, "raylet") == [mine]
        assert procs.ray_children(controller.pid, "gcs_server") == []
        left = procs.marked(tmp_path / "run")
        assert sorted(left) == sorted([controller.pid, mine])
        assert left[mine].startswith("incarnation 1: ")
        assert list(procs.marked(tmp_path / "other")) == [other.pid]
    finally:
        os.killpg(controller.pid, signal.SIGKILL)
        controller.wait()
        other.kill()
        other.wait()
    assert procs.marked(tmp_path / "run") == {}


def test_a_job_is_started_again_only_after_a_whole_job_fault_fired_in_it(tmp_path):
    from planaria.faults.campaign.runner import _whole_job_fault_in

    (tmp_path / "control").mkdir()
    faults = (PlannedFault(index=0, kind="kill", step=7, target=0, micro_batch=0, fraction=0.5),
              PlannedFault(index=1, kind="kill_resumed", step=10, target=0, micro_batch=0,
                           fraction=0.5, variant="controller"))
    run = PlannedRun(index=3, step_s=0.05, steps=14, faults=faults)
    assert _whole_job_fault_in(tmp_path, run, {1}, 100.0, 200.0) is None
    _append(tmp_path / "control" / "fired.jsonl",
            {"id": "r3f0.primary", "action": "kill", "t": 150.0, "pid": 1})
    assert _whole_job_fault_in(tmp_path, run, {1}, 100.0, 200.0) is None  # not a whole-job one
    _append(tmp_path / "control" / "fired.jsonl",
            {"id": "r3f1.primary", "action": "kill_pids", "t": 160.0, "pid": 1})
    # A controller killed: started again at once, its workers left as they are.
    assert _whole_job_fault_in(tmp_path, run, {1}, 100.0, 200.0) == "controller_kill"
    assert _whole_job_fault_in(tmp_path, run, {1}, 200.0, 300.0) is None  # an earlier job's


def test_steps_done_are_those_of_the_faults_own_incarnation():
    """A job started again with no checkpoint trains from step 0: a fault before its first
    commit finds 0 steps done, not the killed job's; a rollback within a job lowers them."""
    from planaria.faults.campaign.timeline import Timeline

    evs = [_ev("run_start"), *[_ev("step_committed", step=s) for s in range(5)],
           _ev("restore", step=2, path="x"), _ev("step_committed", step=2),
           _ev("run_start"), _ev("step_committed", step=0)]
    for i, e in enumerate(evs):
        e["t"] = float(i)
    tl = Timeline(evs, {}, [])
    assert tl.done_before(5.5, 0) == 5
    assert tl.done_before(6.5, 0) == 2  # restored step 2 ...
    assert tl.done_before(7.5, 0) == 3  # ... then step 2 again
    assert tl.done_before(8.5, 1) == 0 and tl.done_before(9.5, 1) == 1


def test_a_restore_after_the_last_holder_died_may_lose_the_steps_since_the_save():
    """kill_join's source killed while its replacement had not yet received the state: no
    replica kept it, so the restore the runtime chose is the recovery; a restore while a
    member of the training generation lived is not."""
    from planaria.faults.campaign.fault_judgement import every_holder_lost
    from planaria.faults.campaign.timeline import Timeline

    def timeline(lost: list[str]) -> Timeline:
        evs = [_ev("run_start"), _ev("generation", workers=["w1", "w2"], reason="join"),
               _ev("fault", worker="w1"), _ev("generation", workers=["w2"], reason="resize"),
               *[_ev("fault", worker=w) for w in lost],
               _ev("generation", workers=["w3"], reason="restore"),
               _ev("restore", step=10, path="x"), _ev("step_committed", step=10)]
        for i, e in enumerate(evs):
            e["t"] = float(i)
        return Timeline(evs, {}, [])

    assert every_holder_lost(timeline(["w2"]), 0, 3.5, 10.0)
    assert not every_holder_lost(timeline([]), 0, 2.5, 10.0)  # w2 held the state


def test_the_verdicts_step_deadline_is_rescaled_to_the_width_as_the_watchdogs():
    """Steps of 8 s at 3 replicas, then the job at 2: the watchdog's window is rescaled by
    3/2 (each rank's share of the batch grows), and so is the deadline a verdict bounds."""
    from planaria.faults.campaign.timeline import Timeline

    evs = [_ev("run_start"), _ev("generation", workers=["w0", "w1", "w2"], reason="start"),
           _ev("step_committed", step=0, width=3, duration_s=8.0),
           _ev("generation", workers=["w1", "w2"], reason="drain")]
    for i, e in enumerate(evs):
        e["t"] = float(i)
    tl = Timeline(evs, {}, [])
    assert tl.deadline(2.5, 0) == 32.0 and tl.width_at(2.5, 0) == 3
    assert tl.deadline(3.5, 0) == 48.0 and tl.members_at(3.5, 0) == ["w1", "w2"]
