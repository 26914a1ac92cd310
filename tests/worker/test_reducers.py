"""The flat reducer (planaria.worker.reduce) on its own, no processes: where the step's status
travels (in the gradient buffer's tail, or beside it) and when the next step's load runs."""

from __future__ import annotations

import torch
from torch import nn

from planaria.worker.reduce import STATUS_TAIL, FlatGradients, FlatReducer


class OneRank:
    """A collective of one rank: every sum is its input. Notes what each call reduced."""

    world_size, rank = 1, 0

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.reduced: list[torch.Tensor] = []

    def allreduce_start(self, tensors: list[torch.Tensor]) -> list[object]:
        self.calls.append("start")
        self.reduced = list(tensors)
        return []

    def wait_all(self, works: list[object]) -> None:
        self.calls.append("wait")


def _reducer(dtype: torch.dtype = torch.float32) -> tuple[FlatReducer, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(dtype)
    grads = FlatGradients(list(model.parameters()), torch.device("cpu"))
    model(torch.randn(2, 4, dtype=dtype)).sum().backward()
    return FlatReducer(grads, global_batch_size=64), model


def test_a_short_status_rides_in_the_gradients_tail_and_comes_back_summed():
    reducer, model = _reducer()
    comm = OneRank()
    status = torch.arange(6, dtype=torch.float64)
    extra: list[torch.Tensor] = []
    norm = reducer.reduce(comm, status, extra, lambda: comm.calls.append("load"))
    assert extra == []  # nothing beside the gradient: one collective
    (flat,) = comm.reduced
    assert flat.numel() == sum(p.numel() for p in model.parameters()) + STATUS_TAIL
    assert torch.equal(status, torch.arange(6, dtype=torch.float64))
    assert comm.calls == ["start", "load", "wait"]  # the load runs while the reduce is in flight
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm().item()
    assert abs(norm - expected) < 1e-5


def test_a_status_longer_than_the_tail_goes_beside_the_gradient():
    reducer, _ = _reducer()
    comm = OneRank()
    status = torch.ones(STATUS_TAIL + 1, dtype=torch.float64)
    extra: list[torch.Tensor] = []
    reducer.reduce(comm, status, extra, lambda: None)
    assert extra == []  # the caller's list: the buffers' contributions alone
    assert comm.reduced[-1] is status


def test_a_model_without_fp32_gradients_has_no_tail():
    reducer, _ = _reducer(torch.bfloat16)
    assert reducer.grads.tail is None
    extra: list[torch.Tensor] = []
    status = torch.zeros(4, dtype=torch.float64)
    comm = OneRank()
    reducer.reduce(comm, status, extra, lambda: None)
    assert extra == [] and comm.reduced[-1] is status  # beside the gradient


def test_zero_drops_the_gradient_and_leaves_the_views_in_place():
    reducer, model = _reducer()
    reducer.zero()
    for p in model.parameters():
        assert p.grad is not None and not p.grad.any()
        assert p.grad.data_ptr() >= reducer.gradients()[0].data_ptr()  # still a view
