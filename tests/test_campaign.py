"""The fault campaign: its schedule, its oracle, its injection machinery, and a real campaign."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from planaria.campaign import KINDS, MixConfig, oracle, plan_campaign, storage_faults
from planaria.campaign.knobs import CampaignLoss, arm_trigger
from planaria.campaign.mix import COMPOUND_KINDS
from planaria.campaign.runner import SUMMARY_KEYS, CampaignConfig, run_campaign
from planaria.checkpoint.storage import Storage
from planaria.data_plan import DataPlan
from planaria.errors import ConfigError

# ---- the schedule ----------------------------------------------------------------------------


def test_schedule_is_seeded_and_deterministic():
    a = plan_campaign(MixConfig(faults=40, seed=7))
    assert a == plan_campaign(MixConfig(faults=40, seed=7))
    assert a != plan_campaign(MixConfig(faults=40, seed=8))


def test_schedule_covers_the_mix_and_every_step_length():
    config = MixConfig(faults=2 * len(KINDS), seed=1)
    runs = plan_campaign(config)
    kinds = [f.kind for r in runs for f in r.faults]
    assert sorted(kinds) == sorted(KINDS * 2)
    assert {r.step_s for r in runs} == set(config.step_lengths)
    for run in runs:
        assert len(run.faults) <= config.faults_per_run[1]
        steps = [f.step for f in run.faults]
        assert steps == [config.lead + i * config.gap for i in range(len(steps))]
        assert steps[0] >= 2 * config.checkpoint_every + 1  # two checkpoints before a rollback
        assert run.steps > steps[-1] + config.tail
        assert [f.kind for f in run.faults].count("job_kill") <= 1
        if "job_kill" in kinds:
            assert all(f.kind != "job_kill" for f in run.faults[:-1])  # the resume runs to the end
        for f in run.faults:
            assert 0 <= f.micro_batch < config.micro_batches and 0 < f.fraction < 1
            assert (f.variant in ("joiner", "source")) == (f.kind == "kill_join")
            assert (f.variant in ("shard", "any")) == f.kind.startswith("storage_")
    assert set(kinds) >= COMPOUND_KINDS


@pytest.mark.parametrize(
    ("field", "value"),
    [("faults", -1), ("kinds", ("kill", "meteor")), ("step_lengths", (0.0,)),
     ("faults_per_run", (4, 2)), ("gap", 1)],
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


def test_restarts_from_zero():
    commits = [_ev("step_committed", step=s) for s in range(6)]
    resumed = [_ev("run_start"), _ev("restore", step=3), _ev("step_committed", step=3)]
    assert oracle.restarts_from_zero([_ev("run_start"), *commits, *resumed]) == []
    over = [_ev("run_start"), *commits, _ev("run_start"), _ev("step_committed", step=0)]
    assert oracle.restarts_from_zero(over)
    scratch = [_ev("run_start"), *commits, _ev("restore", step=0), _ev("step_committed", step=0)]
    assert len(oracle.restarts_from_zero(scratch)) == 2


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
    from planaria.cli import main

    assert main(["campaign", "x.py", "--faults", "3", "--step-s", "fast"]) == 2
    assert "--step-s" in capsys.readouterr().err


# ---- a real campaign -------------------------------------------------------------------------


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
def test_campaign_of_30_faults_recovers_them_all(tmp_path):
    """Five runs of six faults over the whole mix, one of them with 6 s steps (kills there
    leave survivors computing for seconds). About 10 minutes on a busy 2-core machine."""
    import planaria.examples.mlp as mlp

    mix = MixConfig(faults=30, seed=11, step_lengths=(0.05, 0.5, 6.0), faults_per_run=(6, 6),
                    gap=2, checkpoint_every=2, tail=2)
    runs = plan_campaign(mix)
    assert len(runs) == 5 and [r.step_s for r in runs].count(6.0) == 1
    assert {f.kind for r in runs for f in r.faults} == set(KINDS)
    lines: list[str] = []
    summary = run_campaign(
        CampaignConfig(target=str(Path(mlp.__file__)), mix=mix, workdir=tmp_path),
        out=lines.append,
    )
    report = "\n".join(lines) + "\n" + json.dumps(summary)
    assert set(SUMMARY_KEYS) <= set(summary)
    assert summary["faults_injected"] == 30, report
    for key in ("unrecovered", "diverged", "samples_duplicated", "samples_missing",
                "healthy_evicted", "not_injected"):
        assert summary[key] == 0, f"{key}: {summary[key]}\n{report}"
    assert summary["fired_in_runs"] > 0, report  # the autonomous loop users run is exercised


# ---- one run's verdict, on a synthetic run dir -----------------------------------------------


def _synthetic_run(run_dir: Path, *, report_fault: bool = True, evict_w2: bool = False):
    """A 4-step run where w1 was killed at step 2, as the files the campaign reads."""
    from safetensors.torch import save_file

    from planaria.campaign.mix import PlannedFault, PlannedRun

    plan = DataPlan(64, 16, seed=0)
    (run_dir / "control").mkdir(parents=True)
    t = 1000.0
    evs = [_ev("run_start", run_id="x", replicas=3, steps=4),
           _ev("generation", gen=0, workers=["w0", "w1", "w2"], reason="start")]
    evs += [_ev("step_committed", step=s, width=3, duration_s=0.1, samples=16) for s in (0, 1)]
    if report_fault:
        evs += [_ev("fault", fault_id=0, kind="worker_lost", worker="w1", step=2, fault_t=t + 1),
                _ev("detected", fault_id=0, kind="worker_lost", worker="w1", detect_s=0.1)]
    if evict_w2:
        evs.append(_ev("hang_stack", worker="w2", stack=None))
    evs.append(_ev("generation", gen=1, workers=["w0"] if evict_w2 else ["w0", "w2"],
                   reason="resize"))
    evs += [_ev("step_committed", step=s, width=2, duration_s=0.1, samples=16) for s in (2, 3)]
    evs.append(_ev("run_end", status="ok", step=4))
    for i, e in enumerate(evs):
        e["t"] = t + 0.5 * i
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    ledger = "".join(json.dumps({"step": s, "ids": plan.batch(s).tolist()}) + "\n"
                     for s in range(4))
    (run_dir / "ledger.jsonl").write_text(ledger)
    (run_dir / "campaign_job.json").write_text(json.dumps(plan.describe()))
    inj = {"fault": 0, "kind": "kill", "role": "primary", "action": "kill", "id": "r0f0.primary",
           "worker": "w1", "pid": 1, "step": 2, "incarnation": 0, "t": t}
    (run_dir / "campaign_faults.jsonl").write_text(json.dumps(inj) + "\n")
    fired = {"id": "r0f0.primary", "action": "kill", "t": t + 1, "pid": 1}
    (run_dir / "control" / "fired.jsonl").write_text(json.dumps(fired) + "\n")
    weights = {"w": torch.arange(4.0)}
    save_file(weights, str(run_dir / "final.safetensors"))
    fault = PlannedFault(index=0, kind="kill", step=2, target=1, micro_batch=0, fraction=0.5)
    return PlannedRun(index=0, step_s=0.05, steps=4, faults=(fault,)), {4: weights}


def test_verdict_of_a_recovered_run(tmp_path):
    from planaria.campaign.runner import summarize_campaign
    from planaria.campaign.verdict import check_run

    run, refs = _synthetic_run(tmp_path)
    v = check_run(tmp_path, run, refs)
    assert v.ok, v.reasons
    assert v.faults[0].recovered and v.faults[0].recover_s
    summary = summarize_campaign([v])
    assert (summary["faults_injected"], summary["recovered"], summary["unrecovered"]) == (1, 1, 0)


def test_a_fault_in_a_run_is_counted_as_such(tmp_path):
    """The kill fired at t + 1; a run_ahead event whose span covers it marks it in a run."""
    from planaria.campaign.runner import summarize_campaign
    from planaria.campaign.verdict import check_run

    run, refs = _synthetic_run(tmp_path)
    v = check_run(tmp_path, run, refs)
    assert v.faults[0].in_run is False
    events = (tmp_path / "events.jsonl").read_text().splitlines()
    t0 = json.loads(events[0])["t"]
    ran = _ev("run_ahead", gen=0, start=0, until=4, steps=2, ended="failed", why="worker_lost",
              width=3, committed=2, behind=[], started_t=t0 + 0.5)
    ran["t"] = t0 + 1.5
    events.insert(-1, json.dumps(ran))
    (tmp_path / "events.jsonl").write_text("\n".join(events) + "\n")
    v = check_run(tmp_path, run, refs)
    assert v.ok, v.reasons
    assert v.faults[0].in_run is True
    assert summarize_campaign([v])["fired_in_runs"] == 1


def test_the_injector_names_the_boundaries_it_needs(tmp_path):
    """The job runs autonomously between them; a fault armed ``ahead`` steps early fires
    inside the run."""
    from types import SimpleNamespace

    from planaria.campaign.inject import STALE_STEPS, Injector
    from planaria.campaign.mix import PlannedFault, PlannedRun
    from planaria.run_ahead import RunAhead

    faults = (PlannedFault(index=0, kind="kill", step=8, target=1, micro_batch=0, fraction=0.5,
                           ahead=2),
              PlannedFault(index=1, kind="hang", step=11, target=1, micro_batch=1, fraction=0.5))
    inj = Injector(PlannedRun(index=0, step_s=0.05, steps=16, faults=faults), run_dir=tmp_path,
                   control=tmp_path, replicas=3, incarnation=0)
    assert inj.next_step(0) == 6  # armed two steps before its step
    assert inj.next_step(6) == 7  # late: the next step
    inj.todo.pop(0)
    assert inj.next_step(7) == 11
    inj.triggers["r0f0.primary"] = {"step": 6}  # armed at 6, not fired yet: the next fault
    assert inj.next_step(7) == 6 + STALE_STEPS  # waits (its firing ends the run) or goes stale
    (tmp_path / "fired.jsonl").write_text(json.dumps({"id": "r0f0.primary"}) + "\n")
    assert inj.next_step(7) == 11
    inj.todo.pop(0)
    assert inj.next_step(11) == 13  # the tail: back at full width after the last fault
    inj.tail_step = None
    assert inj.next_step(13) is None

    job = SimpleNamespace(hooks=[], recovery=SimpleNamespace(open_work=lambda: False),
                          metric_keys=(), checkpointer=None, config=SimpleNamespace(
                              verify_every=None), width=3, chaos=None)
    ahead = RunAhead(job)  # type: ignore[arg-type]
    assert ahead.next_boundary(0, 16) == 16
    job.hooks.append(Injector(PlannedRun(index=0, step_s=0.05, steps=16, faults=faults),
                              run_dir=tmp_path, control=tmp_path, replicas=3, incarnation=0))
    assert ahead.next_boundary(0, 16) == 6
    job.hooks.append(lambda *a, **k: None)  # a hook that names none needs every boundary
    assert ahead.next_boundary(0, 16) == 1


def test_verdict_catches_what_went_wrong(tmp_path):
    from safetensors.torch import save_file

    from planaria.campaign.verdict import check_run

    run, refs = _synthetic_run(tmp_path / "a", report_fault=False)
    v = check_run(tmp_path / "a", run, refs)
    assert not v.faults[0].recovered and "not in the report" in v.faults[0].reason

    run, refs = _synthetic_run(tmp_path / "b", evict_w2=True)
    v = check_run(tmp_path / "b", run, refs)
    assert v.healthy_evicted == ["0:w2"] and any("healthy worker w2" in r for r in v.reasons)

    run, refs = _synthetic_run(tmp_path / "c")
    save_file({"w": torch.arange(4.0) + 0.5}, str(tmp_path / "c" / "final.safetensors"))
    with (tmp_path / "c" / "ledger.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "ids": [*DataPlan(64, 16, 0).batch(3).tolist(), 0]}) + "\n")
    v = check_run(tmp_path / "c", run, refs)
    assert v.diverged and (v.duplicated, v.missing) == (1, 0)

    run, refs = _synthetic_run(tmp_path / "d")
    v = check_run(tmp_path / "d", run, refs, error="exit code 1: boom")
    assert not v.completed and not v.faults[0].recovered


def test_a_resumed_campaign_judges_again_the_runs_it_finished(tmp_path):
    """`--resume` finds a finished run (only the very run it was made for) and the error its
    job ended with, so that the run is judged again from its files, not run again."""
    import dataclasses

    from planaria.campaign.runner import _keep_run, _kept_run
    from planaria.campaign.verdict import RunVerdict, check_run

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

    from planaria.campaign.runner import _append_record, _recorded
    from planaria.campaign.verdict import check_run

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
    from planaria.campaign.verdict import check_run

    run, refs = _synthetic_run(tmp_path)
    t = 1000.0
    evs = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    cut = [e for e in evs if e["event"] not in ("recovered", "step_committed", "run_end")
           or e.get("step", 0) < 2]
    resumed = [_ev("run_start", run_id="y", replicas=3, steps=4),
               _ev("generation", gen=0, workers=["w0", "w2", "w3"], reason="start"),
               _ev("restore", step=2, reason="resume", lost_steps=0)]
    resumed += [_ev("step_committed", step=s, width=3, duration_s=0.1, samples=16)
                for s in (2, 3)]
    resumed.append(_ev("run_end", status="ok", step=4))
    for i, e in enumerate(resumed):
        e["t"] = t + 20 + 0.5 * i
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in cut + resumed))
    inj = {"fault": 0, "kind": "kill", "role": "primary", "action": "job_kill",
           "id": "r0f0.job", "worker": None, "pid": 1, "step": 2, "incarnation": 0, "t": t}
    with (tmp_path / "campaign_faults.jsonl").open("a") as f:
        f.write(json.dumps(inj) + "\n")
    with (tmp_path / "control" / "fired.jsonl").open("a") as f:
        f.write(json.dumps({"id": "r0f0.job", "action": "job_kill", "t": t + 5, "pid": 1}) + "\n")
    v = check_run(tmp_path, run, refs)
    # from the kill (t + 1) to the resumed job's first commit (t + 21.5)
    assert v.faults[0].recovered and v.faults[0].recover_s == [20.5], v.reasons

    (tmp_path / "control" / "fired.jsonl").write_text(  # no whole-job kill: left open
        (tmp_path / "control" / "fired.jsonl").read_text().splitlines()[0] + "\n")
    v = check_run(tmp_path, run, refs)
    assert not v.faults[0].recovered and "never recovered" in v.faults[0].reason


def test_a_fault_armed_again_on_another_worker_is_judged_where_it_fired(tmp_path):
    """A kill first armed on w2, which left the job (drained) before the trigger's step, is
    armed again on w1 and fires there once (fired.jsonl names w1's pid): the verdict judges
    the kill of w1, not the arming that never fired (found by the 1,000-fault campaign)."""
    from planaria.campaign.verdict import check_run

    run, refs = _synthetic_run(tmp_path)
    faults = tmp_path / "campaign_faults.jsonl"
    first = {"fault": 0, "kind": "kill", "role": "primary", "action": "kill",
             "id": "r0f0.primary", "worker": "w2", "pid": 2, "step": 1, "incarnation": 0,
             "t": 999.0}
    faults.write_text(json.dumps(first) + "\n" + faults.read_text())
    v = check_run(tmp_path, run, refs)
    assert v.ok, v.reasons
    assert v.faults[0].recovered


def test_a_kill_of_the_last_replica_is_rightly_all_replicas_lost(tmp_path):
    """A kill that takes the last replica holding the state (an earlier fault took the
    others) is reported as all_replicas_lost, and the job restores: no complaint."""
    from planaria.campaign.verdict import check_run

    run, refs = _synthetic_run(tmp_path)
    events = tmp_path / "events.jsonl"
    events.write_text(events.read_text().replace('"worker_lost"', '"all_replicas_lost"'))
    v = check_run(tmp_path, run, refs)
    assert v.ok, v.reasons
    events.write_text(events.read_text().replace('"all_replicas_lost"', '"worker_hung"'))
    v = check_run(tmp_path, run, refs)
    assert any("reported as worker_hung" in r for r in v.reasons)


# ---- the independent reference ---------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "bn_mlp", "tiny_gpt"])
def test_the_plain_loop_reference_equals_a_faultless_planaria_run(tmp_path, name):
    """The campaign's reference (one process, no controller, no collective) trains what
    planaria trains at 3 replicas, past an epoch boundary: BatchNorm's statistics composed
    over the ranks, dropout seeded per micro-batch, the scheduler, the clipping."""
    from planaria.campaign.reference import train_reference
    from planaria.campaign.specs import EPOCH_STEPS, build_spec
    from planaria.fit import fit

    spec = build_spec(name, control=None)
    steps = EPOCH_STEPS + 2
    ref = train_reference(spec, [steps])[steps]
    result = fit(spec, steps=steps, replicas=3, run_dir=tmp_path, threads_per_worker=1)
    assert oracle.weights_differ(ref, result.state_dict) is None


def test_the_reference_leaves_a_skipped_sample_out_from_its_step_on():
    from planaria.campaign.reference import train_reference
    from planaria.campaign.specs import build_spec

    spec = build_spec("mlp", control=None)
    plan = DataPlan(640, 64, spec.seed)
    sample = int(plan.batch(3)[5])
    plain = train_reference(spec, [2, 4])
    skipped = train_reference(spec, [2, 4], skip={sample: 3})
    assert oracle.weights_differ(plain[2], skipped[2]) is None  # before its step: the same
    assert oracle.weights_differ(plain[4], skipped[4]) is not None
    late = train_reference(spec, [4], skip={sample: 4})  # armed after its only appearance
    assert oracle.weights_differ(plain[4], late[4]) is None
