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
    st.remove_tree(st.path("d"))
    assert st.listdir() == []


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


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
def test_campaign_of_30_faults_recovers_them_all(tmp_path):
    """Six runs of five faults over the whole mix, one of them with 3 s steps."""
    import planaria.examples.mlp as mlp

    mix = MixConfig(faults=30, seed=11, step_lengths=(0.05, 0.3, 3.0), faults_per_run=(5, 5),
                    gap=2, checkpoint_every=2, tail=2)
    assert 3.0 in {r.step_s for r in plan_campaign(mix)}
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
