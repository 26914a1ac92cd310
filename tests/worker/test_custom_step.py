"""A micro-batch step that calls backward itself (``TrainSpec.forward_backward``) and an
optimizer built from the model (``optimizer_gets="model"``: parameter groups by name)."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from torch import nn

import planaria
from planaria import ConfigError, RecoveryPolicy, RunConfig, TrainSpec, UserCodeError
from planaria.control.startup import check_config
from planaria.examples.mlp import Regression
from planaria.worker.custom_step import StepBackward
from planaria.worker.replica_state import check_optimizer
from planaria.worker.state import flatten_state, load_state
from tests.assertions import assert_exactly_once, assert_same_state, drive, events, of

# The workers unpickle this module's helpers by value: they cannot import the tests package.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, G, M, STEPS = 256, 32, 8, 12


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))


def adamw_with_no_decay_groups(model: nn.Module) -> torch.optim.Optimizer:
    """Hugging Face's grouping: no weight decay on biases and norm weights."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or name.startswith("1.") else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)


def two_losses(model: nn.Module, batch, backward):
    """A main loss, then a penalty on the outputs of a second forward, of noisy inputs (the
    noise from the micro-batch's seeded stream): two forwards, two backwards."""
    x, y = batch
    main = nn.functional.mse_loss(model(x), y)
    backward(main)
    penalty = model(x + 0.1 * torch.randn_like(x)).pow(2).mean()
    backward(0.1 * penalty)
    return main, {"penalty": float(penalty.detach())}


def gradient_penalty(model: nn.Module, batch, backward):
    """A main loss, then a penalty on the gradient of the outputs by the inputs (a second
    backward through the graph of that gradient)."""
    x, y = batch
    main = nn.functional.mse_loss(model(x), y)
    backward(main)
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    penalty = grad.pow(2).sum(dim=1).mean()
    backward(0.01 * penalty)
    return main, {"penalty": float(penalty.detach())}


def make_spec(**overrides) -> TrainSpec:
    fields = dict(
        model=make_model, optimizer=adamw_with_no_decay_groups, optimizer_gets="model",
        forward_backward=two_losses, dataset=lambda: Regression(n=N), global_batch_size=G,
        micro_batch_size=M, grad_clip_norm=1.0, name="custom-step",
    )
    fields.update(overrides)
    return TrainSpec(**fields)  # type: ignore[arg-type]


# ---- the spec's validation ---------------------------------------------------------------

def test_loss_or_forward_backward_exactly_one():
    with pytest.raises(ConfigError, match="exactly one of loss"):
        make_spec(loss=lambda m, b: m(b[0]).mean())
    with pytest.raises(ConfigError, match="exactly one of loss"):
        make_spec(forward_backward=None)
    with pytest.raises(ConfigError, match="forward_backward"):
        make_spec(forward_backward=3)
    with pytest.raises(ConfigError, match="optimizer_gets"):
        make_spec(optimizer_gets="named_parameters")
    assert make_spec(forward_backward=None, loss=lambda m, b: m(b[0]).mean(),
                     optimizer_gets="parameters").optimizer_gets == "parameters"


def test_forward_backward_refused_with_overlap_reduction(tmp_path):
    policy = RecoveryPolicy()
    with pytest.raises(ConfigError, match="overlap_reduction=True is not valid"):
        check_config(make_spec(), RunConfig(steps=1, replicas=1, run_dir=tmp_path,
                                            overlap_reduction=True), policy)


# ---- the optimizer given the model -------------------------------------------------------

def test_a_bad_optimizer_factory_is_named():
    model = make_model()
    check_optimizer(adamw_with_no_decay_groups(model), model, "model")
    with pytest.raises(UserCodeError, match="not an optimizer"):
        check_optimizer([p for p in model.parameters()], model, "model")
    with pytest.raises(UserCodeError, match=r"miss 2 of the model's parameters \(0.bias, 3.bias"):
        check_optimizer(torch.optim.SGD([model[0].weight, model[1].weight, model[1].bias,
                                         model[3].weight], lr=0.1), model, "model")
    with pytest.raises(UserCodeError, match="not parameters of the model"):
        check_optimizer(torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(1))],
                                        lr=0.1), model, "parameters")
    model[0].bias.requires_grad_(False)  # frozen: it may stay out
    check_optimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                    model, "parameters")


def test_param_groups_survive_flatten_and_load():
    """The path of checkpoints and of the state sent to joiners, with two groups."""
    torch.manual_seed(0)
    model = make_model()
    opt = adamw_with_no_decay_groups(model)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    tensors, meta = flatten_state(model, opt, None)
    tensors = {k: v.clone() for k, v in tensors.items()}
    other = make_model()
    other_opt = adamw_with_no_decay_groups(other)
    load_state(other, other_opt, None, tensors, meta)
    assert [g["weight_decay"] for g in other_opt.param_groups] == [0.1, 0.0]
    assert_same_state(opt.state_dict()["state"], other_opt.state_dict()["state"], atol=0, rtol=0)


# ---- the backward a forward_backward is handed -------------------------------------------

@pytest.mark.parametrize("forward_backward", [two_losses, gradient_penalty])
def test_backward_scales_each_call_by_the_share(forward_backward):
    """Two backwards at a share of 1/4: a quarter of the whole loss's gradient."""
    torch.manual_seed(0)
    model, x, y = make_model(), torch.randn(8, 32), torch.randn(8, 1)

    def grads_of(fn) -> list[torch.Tensor]:
        model.zero_grad()
        torch.manual_seed(1)
        fn()
        return [p.grad.clone() for p in model.parameters()]

    backward = StepBackward()
    loss, metrics = None, None

    def run_quarter() -> None:
        nonlocal loss, metrics
        loss, metrics = backward.run(forward_backward, model, (x, y), 0.25, None, None)

    def whole() -> None:
        forward_backward(model, (x, y), lambda t: t.backward())

    quarter = grads_of(run_quarter)
    assert backward.calls == 2 and set(metrics or {}) == {"penalty"}
    assert loss is not None and not loss.requires_grad
    for got, full in zip(quarter, grads_of(whole), strict=True):
        torch.testing.assert_close(got, 0.25 * full)


def test_a_forward_backward_without_backward_is_an_error():
    with pytest.raises(UserCodeError, match="without calling backward"):
        StepBackward().run(lambda m, b, bw: m(b).mean(), make_model(), torch.randn(2, 32),
                           1.0, None, None)
    with pytest.raises(UserCodeError, match="forward_backward function raised"):
        StepBackward().run(lambda m, b, bw: bw(None), make_model(), torch.randn(2, 32),
                           1.0, None, None)
    with pytest.raises(UserCodeError, match="in a sharded replica: FSDP2 frees"):
        StepBackward(sharded=True).run(lambda m, b, bw: bw(None), make_model(),
                                       torch.randn(2, 32), 1.0, None, None)


def test_a_float_loss_and_autocast():
    def step(model, x, backward):
        out = model(x)
        assert out.dtype == torch.bfloat16  # the forward runs under the caller's autocast
        backward(out.float().pow(2).mean())
        return 1.5

    model = make_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, metrics = StepBackward().run(step, model, torch.randn(2, 32), 0.5, None, "cpu")
    assert float(loss) == 1.5 and metrics == {}
    assert all(p.grad is not None and p.grad.dtype == torch.float32
               for p in model.parameters())


# ---- equal across widths and with a kill -------------------------------------------------

@pytest.fixture(scope="module")
def width_one(tmp_path_factory, ray_cluster):
    return planaria.fit(make_spec(), steps=STEPS, replicas=1,
                        run_dir=tmp_path_factory.mktemp("w1"))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_equal_at_width_one_and_three(tmp_path, width_one):
    three = planaria.fit(make_spec(), steps=STEPS, replicas=3, run_dir=tmp_path)
    assert width_one.final_step == three.final_step == STEPS
    assert_same_state(width_one.state_dict, three.state_dict)
    torch.testing.assert_close(torch.tensor(width_one.losses), torch.tensor(three.losses))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_equal_with_a_kill_and_every_sample_once(tmp_path, width_one):
    job = planaria.Job(make_spec(),
                       RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True),
                       chaos=planaria.ChaosPlan.parse("kill:w1@step4"))
    with job:
        drive(job, STEPS, wait_width_at=STEPS - 3)
        state = job.model_state_dict()
    assert job.steps_done == STEPS
    assert_same_state(width_one.state_dict, state)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_lost"]
    assert all(r["lost_steps"] == 0 for r in of(evs, "recovered"))
    assert of(evs, "state_transfer"), "the replacement received no state"


@pytest.mark.slow
def test_a_compiled_model_with_two_backwards():
    """A compiled model's graph, back-propagated twice (``retain_graph``), and a second
    forward: the gradients of the eager model."""
    def step(model, batch, backward):
        x, y = batch
        out = model(x)
        main = nn.functional.mse_loss(out, y)
        backward(main, retain_graph=True)
        backward(0.1 * out.pow(2).mean())
        backward(0.01 * model(2 * x).abs().mean())
        return main

    torch.manual_seed(0)
    eager, x, y = make_model(), torch.randn(8, 32), torch.randn(8, 1)
    compiled_copy = make_model()
    compiled_copy.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_copy, dynamic=False)
    for model in (eager, compiled):
        StepBackward().run(step, model, (x, y), 0.5, None, None)
    for a, b in zip(eager.parameters(), compiled_copy.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_equal_in_sharded_replicas(tmp_path, width_one):
    """Two replicas of two workers (FSDP2 inside): a forward for each backward."""
    sharded = planaria.fit(make_spec(), steps=STEPS, replicas=2, workers_per_replica=2,
                           run_dir=tmp_path)
    assert_same_state(width_one.state_dict, sharded.state_dict)


def test_fp16s_loss_scale_is_applied_to_each_backward():
    torch.manual_seed(0)
    model, x, y = make_model(), torch.randn(8, 32), torch.randn(8, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    torch.manual_seed(1)
    StepBackward().run(two_losses, model, (x, y), 0.5, scaler, None)
    scaled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.manual_seed(1)
    two_losses(model, (x, y), lambda t: t.backward())
    for got, full in zip(scaled, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, 4.0 * full)


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.slow
def test_equal_with_a_compiled_model(tmp_path, width_one):
    """The workers compile the model (warmed up through forward_backward) and train as eager."""
    compiled = planaria.fit(make_spec(compile=True), steps=STEPS, replicas=2, run_dir=tmp_path)
    assert_same_state(width_one.state_dict, compiled.state_dict)
