"""Sharded replicas (``workers_per_replica > 1``) with the models users bring: a Hugging
Face GPT-2 as it ships (its head tied to its embedding) and a model with BatchNorm (its
running statistics: buffers, whole on each worker) train as one worker does, through a kill
too; a module's extra state is refused when the job starts, with the real cause (a planaria
limitation, not the user's code)."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from torch import nn

import planaria
from planaria import ConfigError, Job, RunConfig, TrainSpec, fit
from planaria.examples import bn_mlp
from planaria.worker.replica_state import refuse_unsharded_state
from tests.assertions import assert_exactly_once, assert_same_state, drive, events, of

transformers = pytest.importorskip("transformers")

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, SEQ, VOCAB, G, MBS, STEPS = 96, 16, 64, 16, 2, 8
ATOL = 1e-4  # the shards' sums are reduced in another order than one worker's


def make_gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def tokens() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (N, SEQ), generator=g))


def causal_lm_loss(model: nn.Module, batch) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def gpt2_spec() -> TrainSpec:
    return TrainSpec(model=make_gpt2, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                     loss=causal_lm_loss, dataset=tokens, global_batch_size=G,
                     micro_batch_size=MBS, grad_clip_norm=1.0, name="hf-gpt2")


class WithExtraState(nn.Linear):
    def get_extra_state(self):
        return {"calls": 1}

    def set_extra_state(self, state) -> None:
        pass


def test_a_tied_head_and_buffers_shard_and_extra_state_is_refused_by_its_cause():
    model = make_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight  # as it ships: tied
    refuse_unsharded_state(model, 2)  # the tied head is a parameter, not other state
    refuse_unsharded_state(bn_mlp.make_model(), 2)  # buffers are kept in step
    with pytest.raises(ConfigError, match="workers_per_replica=2 is not valid") as info:
        refuse_unsharded_state(nn.Sequential(nn.Linear(2, 2), WithExtraState(2, 1)), 2)
    text = str(info.value)
    assert "1._extra_state" in text and "a planaria limitation" in text
    assert "raised" not in text and "workers_per_replica=1" in text


def run_with_a_kill(spec: TrainSpec, run_dir, global_batch_size: int) -> dict:
    """2 replicas x 2 workers, w1 killed at step 3; the replacement replica joins (and
    receives the state) before the end. Every sample once, one fault, no step lost."""
    job = Job(spec, RunConfig(steps=STEPS, replicas=2, workers_per_replica=2, run_dir=run_dir,
                              ledger=True), chaos=planaria.ChaosPlan.parse("kill:w1@step3"))
    with job:
        drive(job, STEPS, wait_width_at=STEPS - 2, width=2)
        state = job.model_state_dict()
    assert job.steps_done == STEPS
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=global_batch_size,
                        steps=STEPS)
    evs = events(run_dir)
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_lost"]
    assert all(r["lost_steps"] == 0 for r in of(evs, "recovered"))
    assert of(evs, "state_transfer"), "the replacement received no state"
    return state


@pytest.fixture(scope="module")
def gpt2_reference(tmp_path_factory, ray_cluster):
    """One worker, the whole batch: the weights the sharded runs must end with."""
    return fit(gpt2_spec(), steps=STEPS, replicas=1,
               run_dir=tmp_path_factory.mktemp("gpt2-ref")).state_dict


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_hugging_face_gpt2_in_sharded_replicas_trains_as_one_worker(tmp_path, gpt2_reference):
    result = fit(gpt2_spec(), steps=STEPS, replicas=2, workers_per_replica=2, run_dir=tmp_path)
    assert result.final_step == STEPS
    assert set(result.state_dict) == set(gpt2_reference)  # the tied head's name kept
    assert_same_state(gpt2_reference, result.state_dict, atol=ATOL)


@pytest.mark.extended  # the second variant: a kill takes a replica out, one joins
@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_hugging_face_gpt2_in_sharded_replicas_through_a_kill(tmp_path, gpt2_reference):
    state = run_with_a_kill(gpt2_spec(), tmp_path, G)
    assert_same_state(gpt2_reference, state, atol=ATOL)


def bn_spec() -> TrainSpec:
    # 6 micro-batches: 2 replicas x 2 workers run 2 and 1 (padded with a weightless forward,
    # which must not move the running statistics) each.
    return bn_mlp.make_spec(n=N, global_batch_size=24, micro_batch_size=4)


def bn_state(state: dict) -> dict:
    return {k: v for k, v in state.items() if "running" in k or "num_batches" in k}


@pytest.fixture(scope="module")
def bn_reference(tmp_path_factory, ray_cluster):
    return fit(bn_spec(), steps=STEPS, replicas=1,
               run_dir=tmp_path_factory.mktemp("bn-ref")).state_dict


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_batchnorm_model_in_sharded_replicas_trains_as_one_worker(tmp_path, bn_reference):
    result = fit(bn_spec(), steps=STEPS, replicas=2, workers_per_replica=2, run_dir=tmp_path)
    assert result.final_step == STEPS
    assert len(bn_state(result.state_dict)) == 6
    assert_same_state(bn_state(bn_reference), bn_state(result.state_dict), atol=1e-5)
    assert_same_state(bn_reference, result.state_dict, atol=ATOL)


@pytest.mark.extended  # the second variant: a kill takes a replica out, one joins
@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_batchnorm_model_in_sharded_replicas_through_a_kill(tmp_path, bn_reference):
    """The joining replica receives the running statistics with the shards."""
    state = run_with_a_kill(bn_spec(), tmp_path, 24)
    assert_same_state(bn_state(bn_reference), bn_state(state), atol=1e-5)
    assert_same_state(bn_reference, state, atol=ATOL)


@pytest.mark.extended  # the checkpoint of the same state the kill test sends to a joiner
@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_batchnorm_models_sharded_checkpoint_holds_its_statistics(tmp_path, bn_reference):
    """Saved by 2 x 2 workers at step 4, resumed by one replica of 2 workers: the running
    statistics come back, and the end is the fault-free one."""
    from planaria.checkpoint import list_checkpoints, read_manifest
    from planaria.checkpoint.config import CheckpointConfig

    fit(bn_spec(), steps=4, replicas=2, workers_per_replica=2, run_dir=tmp_path,
        checkpoint=CheckpointConfig(every=4))
    (saved,) = [c for c in list_checkpoints(str(tmp_path / "checkpoints")) if c.committed]
    names = set(read_manifest(saved.path).tensors)
    assert {"model/1.running_mean", "model/5.running_var"} <= names
    result = fit(bn_spec(), steps=STEPS, replicas=1, workers_per_replica=2, run_dir=tmp_path,
                 checkpoint=CheckpointConfig(resume=True))
    assert [r["step"] for r in of(events(tmp_path), "restore")] == [4]
    assert_same_state(bn_state(bn_reference), bn_state(result.state_dict), atol=1e-5)
    assert_same_state(bn_reference, result.state_dict, atol=ATOL)
