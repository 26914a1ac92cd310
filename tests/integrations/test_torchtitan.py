"""The torchtitan adapter: torchtitan's debug Llama and its Trainer.Config trained elastic,
equal to a one-process loop made of torchtitan's own builders on the same batches; what it
refuses, by name."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torchtitan")

import ray
import torch
from torch.utils.data import default_collate
from torchtitan.components.loss import MSELoss
from torchtitan.components.optimizer import ParamGroupConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel

import planaria
from planaria import ConfigError, RunConfig
from planaria.data.plan import DataPlan
from planaria.data.randomness import factory_seed, seed_globals
from planaria.integrations import torchtitan as adapter
from tests.assertions import (
    assert_exactly_once,
    assert_one_kill_healed_by_a_transfer,
    assert_the_reference_training,
    drive,
    events,
)

# The workers unpickle this module's helpers by value: they cannot import the tests package.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SEQ, M, REPLICAS, N, STEPS, VOCAB = 16, 4, 2, 64, 6, 2048
G = M * REPLICAS  # training.global_batch_size=-1: local_batch_size x replicas at start


def small_config(steps: int = STEPS):
    """llama3_debugmodel shrunk for the CPU: two of its six layers, 16-token windows, and
    torchtitan's SDPA inner attention in place of flex attention (which has no backward on
    the CPU; with one document per window both are causal attention)."""
    config = llama3_debugmodel()
    model = config.model_spec.model
    model.layers = model.layers[:2]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training.seq_len, config.training.local_batch_size = SEQ, M
    config.training.steps = steps
    return config


def windows() -> adapter.TokenWindows:
    g = torch.Generator().manual_seed(0)
    return adapter.TokenWindows(torch.randint(0, VOCAB, (N * SEQ + 1,), generator=g), SEQ)


def titan_reference(steps: int) -> dict[str, torch.Tensor]:
    """torchtitan's Trainer in one process, by its own parts: the model built on the meta
    device and initialised by init_weights (the generators seeded as planaria's workers
    seed them), its ChunkedLossWrapper on the lm_head, its optimizer and scheduler
    containers, its clip_grad_norm_; fed the plan's batches in micro-batches of
    local_batch_size, each loss divided by the step's valid tokens."""
    config = small_config(steps)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    seed_globals(factory_seed(0, "model"))
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = config.loss.build(compile_config=config.compile)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = config.optimizer.build(model_parts=[model])
    schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=steps)
    plan, data = DataPlan(N, G, 0), windows()
    for step in range(steps):
        optimizers.zero_grad()
        ids = [int(i) for i in plan.batch(step)]
        micro = [default_collate([data[i] for i in ids[k:k + M]]) for k in range(0, G, M)]
        valid_tokens = sum((labels != -100).sum() for _, labels in micro)
        for input_dict, labels in micro:
            pred = model(input_dict["input"], positions=input_dict["positions"])
            loss, _ = loss_fn(pred, labels, valid_tokens, positions=input_dict["positions"])
            loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), config.training.max_norm,
                                   foreach=True)
        optimizers.step()
        schedulers.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- the target: equal to torchtitan's own loop ---------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.slow
def test_equal_to_torchtitans_loop_with_a_kill(tmp_path, ray_cluster):
    job_spec = adapter.spec_from_torchtitan(small_config(), windows, replicas=REPLICAS)
    assert (job_spec.steps, job_spec.spec.global_batch_size) == (STEPS, G)
    job = planaria.Job(job_spec.spec, RunConfig(steps=job_spec.steps, replicas=REPLICAS,
                                                run_dir=tmp_path, ledger=True),
                       chaos=planaria.ChaosPlan.parse("kill:w1@step3"))
    with job:
        drive(job, STEPS, wait_width_at=STEPS - 2, width=REPLICAS)
        state = job.model_state_dict()
    assert job.steps_done == STEPS
    assert_the_reference_training(state, titan_reference, STEPS)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    assert_one_kill_healed_by_a_transfer(evs)


# ---- the parts, in this process -------------------------------------------------------------

def test_the_spec_maps_the_config():
    config = small_config()
    config.debug.seed, config.training.max_norm = 7, 0.5
    job = adapter.spec_from_torchtitan(config, windows, replicas=3)
    spec = job.spec
    assert (job.steps, spec.global_batch_size, spec.micro_batch_size) == (STEPS, 3 * M, M)
    assert (spec.seed, spec.grad_clip_norm, spec.optimizer_gets) == (7, 0.5, "model")
    assert spec.name == "llama3-debugmodel"
    config.training.global_batch_size = 4 * M  # given: kept whatever the replicas
    assert adapter.spec_from_torchtitan(config, windows, replicas=3).spec.global_batch_size \
        == 4 * M
    model = spec.model()
    optimizer = spec.optimizer(model)
    assert type(optimizer) is torch.optim.AdamW
    (group,) = optimizer.param_groups
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"], group["fused"]) \
        == (8e-4, (0.9, 0.95), 1e-8, 0.1, True)
    scheduler = spec.lr_scheduler(optimizer)
    rates = []
    for _ in range(STEPS):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    # warmup_steps=2; decay_ratio=0.8 asks round(4.8)=5 decay steps, which torchtitan trims
    # to the 4 left; a stable step between (and its virtual last step); linear decay
    expected = [4e-4, 8e-4, 8e-4, 6e-4, 4e-4, 2e-4]
    assert rates == pytest.approx(expected)


def test_the_step_is_torchtitans_loss_scaled_to_its_share():
    """One micro-batch of M samples of a global batch of 2M: the gradient is torchtitan's
    for the step's valid tokens (2M x SEQ), the logged loss the micro-batch's mean."""
    job = adapter.spec_from_torchtitan(small_config(), windows, replicas=2)
    seed_globals(0)
    model = job.spec.model()
    batch = default_collate([windows()[i] for i in range(M)])
    share = M / G

    def backward(tensor: torch.Tensor) -> None:
        (tensor * share).backward()

    loss = job.spec.forward_backward(model, batch, backward)
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss_fn = small_config().loss.build(compile_config=None)
    loss_fn.set_lm_head(model.lm_head)
    input_dict, labels = batch
    theirs_loss, _ = loss_fn(model(input_dict["input"], positions=input_dict["positions"]),
                             labels, torch.tensor(G * SEQ), positions=input_dict["positions"])
    theirs_loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, msg=name)
    assert float(loss) == pytest.approx(float(theirs_loss.detach()) / share, rel=1e-6)


def test_token_windows_cut_a_stream_into_samples():
    data = adapter.TokenWindows(torch.arange(10), 3)
    assert len(data) == 3
    inputs, labels = data[1]
    assert inputs["input"].tolist() == [3, 4, 5] and labels.tolist() == [4, 5, 6]
    assert inputs["positions"].tolist() == [0, 1, 2]
    with pytest.raises(IndexError):
        data[3]
    with pytest.raises(ConfigError, match="seq_len"):
        adapter.TokenWindows(torch.arange(3), 3)


def _set(path: str, value):
    def change(config):
        section, name = path.split(".")
        setattr(getattr(config, section), name, value)
    return change


def _muon(config):
    config.optimizer.param_groups = [
        ParamGroupConfig(pattern=r"\.weight$", optimizer_name="AdamW",
                         optimizer_kwargs={"lr": 1e-3}),
        ParamGroupConfig(pattern=".*", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-3})]


def _mse(config):
    config.loss = MSELoss.Config()


@pytest.mark.parametrize("change, named", [
    (_set("parallelism.tensor_parallel_degree", 2), r"parallelism\.tensor_parallel_degree=2: "
     "tensor parallelism is not supported"),
    (_set("parallelism.pipeline_parallel_degree", 2), "parallelism.pipeline_parallel_degree=2"),
    (_set("parallelism.context_parallel_degree", 2), "parallelism.context_parallel_degree=2"),
    (_set("parallelism.expert_parallel_degree", 2), "parallelism.expert_parallel_degree=2"),
    (_set("parallelism.data_parallel_shard_degree", 4),
     r"data_parallel_shard_degree=4: FSDP inside a replica"),
    (_set("parallelism.data_parallel_replicate_degree", 2),
     r"data_parallel_replicate_degree=2: planaria's width is RunConfig.replicas"),
    (_set("compile.enable", True), r"compile\.enable=True: torchtitan compiles each block"),
    (_set("checkpoint.enable", True), r"checkpoint\.enable=True: planaria checkpoints"),
    (_set("checkpoint.initial_load_path", "/ckpt"), r"checkpoint\.initial_load_path='/ckpt'"),
    (_set("validator.enable", True), r"validator\.enable=True"),
    (_set("training.enable_cpu_offload", True), r"training\.enable_cpu_offload=True"),
    (_set("debug.deterministic", True), r"debug\.deterministic=True"),
    (_set("override.imports", ["my.overrides"]), r"override\.imports=\['my.overrides'\]"),
    (_set("optimizer.implementation", "fused_opt_states_bf16"), "fused_opt_states_bf16"),
    (_muon, r"optimizer_name \['Adam', 'AdamW'\] is refused: planaria steps one"),
    (_mse, r"loss=MSELoss.Config\(MSELoss.Config\) is refused"),
    (_set("training.max_norm", 0.0), r"training\.max_norm=0\.0"),
])
def test_what_cannot_be_honoured_is_refused_by_name(change, named):
    config = small_config()
    change(config)
    with pytest.raises(ConfigError, match=named):
        adapter.spec_from_torchtitan(config, windows, replicas=2)


def test_every_refused_field_is_named_at_once():
    config = small_config()
    config.parallelism.tensor_parallel_degree = 2
    config.compile.enable = True
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree=2.*; compile\.enable=True"):
        adapter.spec_from_torchtitan(config, windows, replicas=2)


def test_the_dataset_is_a_factory():
    with pytest.raises(ConfigError, match="give a factory"):
        adapter.spec_from_torchtitan(small_config(), windows(), replicas=2)


def test_without_torchtitan_the_import_error_names_the_extra():
    code = textwrap.dedent("""
        import sys
        sys.modules["torchtitan"] = None
        try:
            import planaria.integrations.torchtitan
        except ImportError as err:
            print(err)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert 'pip install "planaria[torchtitan]"' in out


def test_a_state_filled_in_place_reaches_the_fused_qkv_weights():
    """torchtitan's fused QKV linear saves its wqkv as wq/wk/wv copies (state_dict hooks): a
    joiner or a restore that fills the state dict's tensors in place must load those
    through load_state_dict, or the joiner keeps its own initial wqkv."""
    from planaria.worker.state import load_hooked_model_tensors

    spec = adapter.spec_from_torchtitan(small_config(), windows, replicas=2).spec
    seed_globals(1)
    source = spec.model()
    seed_globals(2)
    joiner = spec.model()
    tensors = {f"model/{k}": v.clone() for k, v in source.state_dict().items()}
    with torch.no_grad():
        for name, target in joiner.state_dict().items():  # the fill in place
            target.copy_(tensors[f"model/{name}"])
        load_hooked_model_tensors(joiner, tensors)
    for name, param in source.named_parameters():
        torch.testing.assert_close(dict(joiner.named_parameters())[name], param, msg=name)
