"""A joiner's optimizer state made by a probe has the layout one step would make, and a
state loaded into it is the source's."""

from __future__ import annotations

import pytest
import torch

from planaria.worker.optimizer_layout import prebuild_by_probe
from planaria.worker.state import flatten_state, load_state

OPTIMIZERS = [
    (torch.optim.Adam, {"lr": 1e-3}),
    (torch.optim.AdamW, {"lr": 1e-3, "amsgrad": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adagrad, {}),
    (torch.optim.RMSprop, {"momentum": 0.5, "centered": True}),
]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))
    m[0].bias.requires_grad_(False)  # frozen: no state
    return m


def stepped(cls, kwargs, *, groups: bool = False):
    m = model()
    params = ([{"params": list(m[0].parameters())}, {"params": list(m[1:].parameters()),
                                                     "weight_decay": 0.1}]
              if groups else m.parameters())
    opt = cls(params, **kwargs)
    for p in m.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    opt.step()
    return m, opt


def layout(m, opt) -> dict:
    tensors, _ = flatten_state(m, opt, None)
    return {k: (tuple(v.shape), v.dtype) for k, v in tensors.items() if k.startswith("optim/")}


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS)
@pytest.mark.parametrize("groups", [False, True])
def test_a_probed_state_has_the_layout_of_a_stepped_one_and_loads_the_source(cls, kwargs,
                                                                          groups):
    src_model, src = stepped(cls, kwargs, groups=groups)
    m = model()
    params = ([{"params": list(m[0].parameters())}, {"params": list(m[1:].parameters()),
                                                     "weight_decay": 0.1}]
              if groups else m.parameters())
    opt = cls(params, **kwargs)
    assert prebuild_by_probe(opt)
    assert layout(m, opt) == layout(src_model, src)
    live, _ = flatten_state(m, opt, None)
    tensors, meta = flatten_state(src_model, src, None)
    for k, v in tensors.items():
        if k.startswith("optim/"):
            live[k].copy_(v)  # received in place
    load_state(None, opt, None, {k: live[k] for k in live if k.startswith("optim/")}, meta)
    got, _ = flatten_state(m, opt, None)
    for k, v in tensors.items():
        if k.startswith("optim/"):
            assert torch.equal(got[k], v), k


def test_an_optimizer_with_no_state_or_no_probe_is_left_to_a_step():
    m = model()
    assert not prebuild_by_probe(torch.optim.SGD(m.parameters(), lr=0.1))  # no state at all

    class Odd(torch.optim.SGD):
        def __init__(self, params, scale):  # not rebuilt from its defaults
            super().__init__(params, lr=0.1 * scale, momentum=0.9)

    odd = Odd(m.parameters(), 2.0)
    assert not prebuild_by_probe(odd)
    assert not odd.state
