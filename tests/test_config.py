"""Bad input gets a clear error that names the field, the value and what is accepted."""

from __future__ import annotations

import contextlib

import pytest
import torch

from planaria import ConfigError, HangConfig, RecoveryPolicy, RunConfig, TrainSpec
from planaria.data.plan import DataPlan, split_micro_batches
from planaria.examples import mlp
from planaria.faults.chaos import ChaosPlan


def spec(**overrides):
    fields = dict(
        model=mlp.make_model,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss=mlp.mse,
        dataset=mlp.Regression,
        global_batch_size=64,
        micro_batch_size=16,
    )
    fields.update(overrides)
    return TrainSpec(**fields)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"global_batch_size": 60}, ["global_batch_size=60", "multiple of micro_batch_size=16"]),
        ({"global_batch_size": 0}, ["global_batch_size=0", ">= 1"]),
        ({"micro_batch_size": -2}, ["micro_batch_size=-2", ">= 1"]),
        ({"model": "not callable"}, ["model=", "callable"]),
        ({"grad_clip_norm": 0.0}, ["grad_clip_norm=0.0", "positive"]),
        ({"lr_scheduler": 3}, ["lr_scheduler=3", "callable or None"]),
        ({"eval_dataset": "val.jsonl"}, ["eval_dataset='val.jsonl'", "callable"]),
        ({"eval_dataset": mlp.Regression, "evaluate": {"loss": 0}}, ["evaluate=", "callable"]),
        ({"eval_dataset": mlp.Regression, "eval_batch_size": 0},
         ["eval_batch_size=0", ">= 1 or None"]),
        ({"eval_dataset": mlp.Regression, "eval_collate": "stack"},
         ["eval_collate='stack'", "callable or None"]),
        # A custom step has no loss to evaluate by default: evaluate is needed, by name.
        ({"eval_dataset": mlp.Regression, "loss": None, "forward_backward": print},
         ["evaluate=None", "no loss to evaluate by default"]),
    ],
)
def test_train_spec_rejects_bad_values(overrides, words):
    with pytest.raises(ConfigError) as info:
        spec(**overrides)
    for word in words:
        assert word in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"replicas": 0}, ["replicas=0", ">= 1"]),
        ({"steps": 0}, ["steps=0", ">= 1"]),
        ({"cpus_per_worker": 0}, ["cpus_per_worker=0"]),
        ({"join_timeout_s": -1}, ["join_timeout_s=-1", "seconds"]),
        ({"placement": "SPREAD"}, ["placement='SPREAD'", "'strict_spread'"]),
        ({"store_host": ""}, ["store_host=''", "non-empty"]),
        ({"network_interface": " eth0"}, ["network_interface=' eth0'"]),
        ({"eval_every": 0}, ["eval_every=0", ">= 1"]),
        ({"eval_every": 2.5}, ["eval_every=2.5", "committed steps between evaluations"]),
    ],
)
def test_run_config_rejects_bad_values(tmp_path, kwargs, words):
    base = {"steps": 10, "replicas": 2, "run_dir": tmp_path}
    with pytest.raises(ConfigError) as info:
        RunConfig(**{**base, **kwargs})
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"on_worker_lost": "explode"}, ["on_worker_lost='explode'", "'resize'"]),
        ({"on_nonfinite": "ignore"}, ["on_nonfinite='ignore'", "'skip'"]),
        ({"min_replicas": 0}, ["min_replicas=0"]),
        ({"pause_timeout_s": 0}, ["pause_timeout_s=0"]),
        ({"retry_policy": 5}, ["retry_policy=5", "callable"]),
    ],
)
def test_policy_rejects_bad_values(kwargs, words):
    with pytest.raises(ConfigError) as info:
        RecoveryPolicy(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_hang_config_rejects_a_timeout_shorter_than_the_heartbeat():
    with pytest.raises(ConfigError, match=r"heartbeat_timeout_s=0\.1"):
        HangConfig(heartbeat_s=0.5, heartbeat_timeout_s=0.1)


def test_an_eval_set_is_optional_and_evaluates_by_the_loss_when_evaluate_is_none():
    assert spec().eval_dataset is None and spec().eval_batch_size is None
    assert spec().eval_collate is None  # the eval set is batched by the training's collate
    with_eval = spec(eval_dataset=mlp.Regression)  # evaluate: {"loss": loss(model, batch)}
    assert with_eval.evaluate is None and with_eval.loss is mlp.mse


def test_dataset_smaller_than_one_global_batch():
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        DataPlan(10, 64, seed=0)


def test_job_rejects_min_replicas_above_replicas_and_too_many_replicas(tmp_path):
    from planaria import Job

    with pytest.raises(ConfigError, match="min_replicas=3"):
        Job(
            spec(),
            RunConfig(steps=5, replicas=2, run_dir=tmp_path),
            policy=RecoveryPolicy(min_replicas=3),
        )
    with pytest.raises(ConfigError, match="replicas=65"):
        Job(spec(), RunConfig(steps=5, replicas=65, run_dir=tmp_path))


def test_job_rejects_eval_every_without_an_eval_set(tmp_path):
    from planaria import Job

    with pytest.raises(ConfigError, match="eval_every=2 is not valid without an eval set"):
        Job(spec(), RunConfig(steps=5, replicas=1, run_dir=tmp_path, eval_every=2))


@pytest.mark.parametrize(
    "text", ["kill:w1", "explode:w1@step3", "kill:x@step3", "kill:w1@soon", ""]
)
def test_chaos_plan_rejects_bad_events(text):
    with pytest.raises(ConfigError, match=r"ACTION:TARGET@WHEN|empty"):
        ChaosPlan.parse(text)


def test_chaos_plan_parses_and_fires_once():
    plan = ChaosPlan.parse("kill:w1@step40,hang:random@2.5s,preempt:w2@poisson30s", seed=1)
    assert str(plan) == "kill:w1@step40,hang:random@2.5s,preempt:w2@poisson30s"
    assert [str(e) for e in plan.due(step=39, elapsed_s=0)] == []
    assert [str(e) for e in plan.due(step=40, elapsed_s=0)] == ["kill:w1@step40"]
    assert [str(e) for e in plan.due(step=41, elapsed_s=3)] == ["hang:random@2.5s"]
    fired = sum(len(plan.due(step=None, elapsed_s=t)) for t in range(0, 3000, 1))
    assert 60 <= fired <= 140  # about one every 30 s over 3000 s


def test_data_plan_is_a_stream_of_epochs_with_every_sample_once():
    plan = DataPlan(100, 32, seed=3)
    stream = [int(i) for s in range(25) for i in plan.batch(s)]  # 8 epochs exactly
    for epoch in range(8):
        assert sorted(stream[epoch * 100 : (epoch + 1) * 100]) == list(range(100))
    assert (plan.batch(3) == DataPlan(100, 32, seed=3).batch(3)).all()
    assert not (plan.batch(0) == DataPlan(100, 32, seed=4).batch(0)).all()
    assert plan.position(25) == {"samples_consumed": 800, "epoch": 8, "offset_in_epoch": 0}


def test_split_is_contiguous_whole_micro_batches_and_near_equal():
    import numpy as np

    ids = np.arange(64)
    parts = split_micro_batches(ids, 3, 8)
    assert [len(p) for p in parts] == [24, 24, 16]
    assert np.concatenate(parts).tolist() == ids.tolist()


def test_a_local_ray_start_that_times_out_is_tried_again(tmp_path, monkeypatch):
    """On a loaded machine Ray's local node can time out during startup: the job starts it
    again (bounded) instead of failing; any other error, or the last try's, is raised."""
    from types import SimpleNamespace

    import ray

    from planaria import backoff
    from planaria.config import RunConfig
    from planaria.control import startup

    class Marker:  # the reaper's side of a Ray start (startup.ProcessMarker)
        def __init__(self) -> None:
            self.sessions: list[str] = []

        def marking(self) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

        def session(self, session_dir: str) -> None:
            self.sessions.append(session_dir)

    calls: list[dict] = []

    def flaky_init(**kwargs):
        calls.append(kwargs)
        if len(calls) < 3:
            raise Exception("The current node timed out during startup. This could happen ...")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", flaky_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(backoff.time, "sleep", lambda s: None)
    reaper = Marker()
    monkeypatch.setattr(ray._private.worker, "_global_node",
                        SimpleNamespace(get_session_dir_path=lambda: "/tmp/ray/session_x"))
    config = RunConfig(steps=1, replicas=2, run_dir=tmp_path)
    assert startup.init_ray(config, tmp_path, reaper)  # it started Ray
    assert len(calls) == 3
    assert reaper.sessions == ["/tmp/ray/session_x"]  # the started session's processes

    calls.clear()
    monkeypatch.setattr(startup, "RAY_START_ATTEMPTS", 2)
    with pytest.raises(Exception, match="timed out during startup"):
        startup.init_ray(config, tmp_path, reaper)
    assert len(calls) == 2

    def broken_init(**kwargs):
        calls.append(kwargs)
        raise ValueError("bad option")

    calls.clear()
    monkeypatch.setattr(ray, "init", broken_init)
    with pytest.raises(ValueError, match="bad option"):
        startup.init_ray(config, tmp_path, reaper)
    assert len(calls) == 1
