"""A joiner's model built without its random initialisation (planaria.worker.skip_init):
nothing drawn, every parameter 0, buffers as the module made them, torch.nn.init itself
again after."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import init

from planaria.worker.skip_init import INIT_FUNCTIONS, initialisation_skipped, zero_parameters


class WithBuffers(nn.Module):
    """Parameters drawn by reset_parameters, a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.register_buffer("angles", torch.arange(8.0) * math.pi / 8, persistent=False)


def test_nothing_is_drawn_and_every_parameter_is_0() -> None:
    before = torch.get_rng_state()
    with initialisation_skipped():
        model = WithBuffers()
    assert torch.equal(torch.get_rng_state(), before)  # no weight was drawn
    zero_parameters(model)
    assert all(not p.any() for p in model.parameters())


def test_buffers_stay_as_the_module_made_them() -> None:
    with initialisation_skipped():
        model = WithBuffers()
    zero_parameters(model)
    assert torch.equal(model.angles, torch.arange(8.0) * math.pi / 8)
    assert torch.equal(model.norm.running_var, torch.ones(8))
    assert torch.equal(model.norm.running_mean, torch.zeros(8))


def test_torch_nn_init_draws_again_after_even_on_an_error() -> None:
    originals = {name: getattr(init, name) for name in INIT_FUNCTIONS}
    try:
        with initialisation_skipped():
            raise RuntimeError("the factory failed")
    except RuntimeError:
        pass
    assert {name: getattr(init, name) for name in INIT_FUNCTIONS} == originals
    weight = nn.Linear(64, 64).weight
    assert weight.abs().sum() > 0


def test_a_state_loaded_into_it_is_the_state_of_a_drawn_model() -> None:
    torch.manual_seed(3)
    drawn = WithBuffers()
    with initialisation_skipped():
        joiner = WithBuffers()
    zero_parameters(joiner)
    joiner.load_state_dict(drawn.state_dict())
    batch = torch.randint(50, (4,))
    drawn.eval(), joiner.eval()
    assert torch.equal(drawn.proj(drawn.embed(batch)), joiner.proj(joiner.embed(batch)))
