"""Sharded replicas (``workers_per_replica > 1``) with the models users bring: a Hugging
Face GPT-2 as it ships (its head tied to its embedding) trains as one worker does, through a
kill too; a model with persistent buffers (BatchNorm) is refused when the job starts, with
the real cause (a planaria limitation, not the user's code)."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from torch import nn

from planaria import ConfigError, TrainSpec, fit
from planaria.examples import bn_mlp
from planaria.worker.replica_state import refuse_unsharded_state
from tests.assertions import assert_exactly_once, assert_same_state, events, of

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


def test_a_tied_head_shards_and_batchnorm_is_refused_by_its_cause():
    model = make_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight  # as it ships: tied
    refuse_unsharded_state(model, 2)  # the tied head is a parameter, not a buffer
    with pytest.raises(ConfigError, match="workers_per_replica=2 is not valid") as info:
        refuse_unsharded_state(bn_mlp.make_model(), 2)
    text = str(info.value)
    assert "1.running_mean" in text and "a planaria limitation" in text
    assert "raised" not in text and "workers_per_replica=1" in text


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
    result = fit(gpt2_spec(), steps=STEPS, replicas=2, workers_per_replica=2, run_dir=tmp_path,
                 ledger=True, chaos="kill:w1@step3")
    assert result.final_step == STEPS
    assert_same_state(gpt2_reference, result.state_dict, atol=ATOL)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    assert [f["kind"] for f in of(events(tmp_path), "fault")] == ["worker_lost"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_batchnorm_model_in_sharded_replicas_is_refused_at_start(tmp_path):
    spec = bn_mlp.make_spec(n=64, global_batch_size=16, micro_batch_size=4)
    with pytest.raises(ConfigError, match="persistent buffers") as info:
        fit(spec, steps=2, replicas=1, workers_per_replica=2, run_dir=tmp_path)
    assert "not an error in your model" in str(info.value)
