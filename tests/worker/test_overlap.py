"""The gradient all-reduce overlapped with backward: the same sums as one reduction after
it, buckets started in one order on every rank whatever order backward completes them,
unused parameters and ranks without a micro-batch included; and end to end, the same
training as without overlap, with a kill."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist
from torch import nn

from planaria import fit
from planaria.examples import mlp
from planaria.worker.collective import Collective
from planaria.worker.reduce_overlapped import GradientBuckets
from tests.assertions import assert_exactly_once, assert_same_state, events, of

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 64)
        self.unused = nn.Linear(3, 3)  # never gets a gradient: its bucket starts at finish
        self.c = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def flat_grads(model: nn.Module) -> list[torch.Tensor]:
    """Binds every .grad to one flat buffer (as the worker does); returns the buffer."""
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    off = 0
    for p in params:
        p.grad = flat[off : off + p.numel()].view_as(p)
        off += p.numel()
    return [flat]


def train_rank(model: nn.Module, rank: int, world: int, store: dist.Store, micro: int,
               overlap: bool, out: dict[int, torch.Tensor], bucket_bytes: int) -> None:
    bufs = flat_grads(model)
    comm = Collective(store, 0, rank, world, join_timeout_s=30, timeout_s=30)
    reducer = GradientBuckets(bufs, [list(model.parameters())], bucket_bytes=bucket_bytes)
    g = torch.Generator().manual_seed(rank)
    for j in range(micro):
        if overlap and j == micro - 1:
            reducer.arm(comm)
        model(torch.randn(8, 32, generator=g)).pow(2).sum().backward()
    if overlap:
        if not reducer.armed:
            reducer.arm(comm)
        reducer.finish()
    else:
        comm.allreduce_sum(bufs)
    out[rank] = bufs[0].clone()
    comm.close()


def run_ranks(micro: list[int], overlap: bool, bucket_bytes: int = 4096) -> dict[int, torch.Tensor]:
    store = dist.HashStore()
    out: dict[int, torch.Tensor] = {}
    models = [Net() for _ in micro]  # built here: the global generator is not thread-safe
    threads = [threading.Thread(target=train_rank, args=(models[r], r, len(micro), store,
                                                         micro[r], overlap, out, bucket_bytes))
               for r in range(len(micro))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(out) == len(micro), "a rank did not finish"
    return out


@pytest.mark.parametrize("micro", [[2, 2, 2], [3, 1, 0]])  # a rank may get no micro-batch
def test_overlapped_buckets_sum_like_one_reduction(micro: list[int]) -> None:
    plain = run_ranks(micro, overlap=False)
    overlapped = run_ranks(micro, overlap=True)
    for r in range(len(micro)):
        torch.testing.assert_close(overlapped[r], plain[0])
        torch.testing.assert_close(overlapped[r], overlapped[0], rtol=0, atol=0)


def test_buckets_cover_the_buffer_in_reverse_order() -> None:
    model = Net()
    bufs = flat_grads(model)
    reducer = GradientBuckets(bufs, [list(model.parameters())], bucket_bytes=4096)
    ptrs = [b.data_ptr() for b in reducer.buckets]
    assert ptrs == sorted(ptrs, reverse=True)  # the last layers' gradients first
    assert sum(b.numel() for b in reducer.buckets) == bufs[0].numel()
    reducer.remove()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ray_cluster):
    return fit(mlp.make_spec(n=512), steps=12, replicas=2,
               run_dir=tmp_path_factory.mktemp("ref")).state_dict


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_training_with_overlap_equals_training_without_with_a_kill(tmp_path: Path,
                                                                   reference) -> None:
    result = fit(mlp.make_spec(n=512), steps=12, replicas=3, run_dir=tmp_path, ledger=True,
                 overlap_reduction=True, chaos="kill:w1@step5")
    assert result.final_step == 12
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(tmp_path, num_samples=512, global_batch_size=64, steps=12)
    assert [f["kind"] for f in of(events(tmp_path), "fault")] == ["worker_lost"]


class SlowBackward(torch.autograd.Function):
    """Identity forward; its backward takes ``0.4`` s (a long backward, in which a peer's
    death arrives while the overlapped reduction's hooks run)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        import time

        time.sleep(0.4)
        return grad


class SlowBackwardMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = mlp.make_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # At the output: backward waits first, then the parameters' gradients complete
        # and their hooks start the buckets' reductions.
        return SlowBackward.apply(self.inner(x))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_peer_dying_during_an_overlapped_backward_is_a_death_not_a_user_error(tmp_path):
    """The survivors are told to abandon the step while their backward's hooks reduce
    buckets: the hook's StepAborted must not read as the user's code failing."""
    import planaria
    from planaria import Job, RunConfig
    from tests.assertions import run_to
    from tests.loop_faults import SignalSelfAt, install

    base = mlp.make_spec(n=512)
    spec = planaria.TrainSpec(model=SlowBackwardMLP, optimizer=base.optimizer, loss=base.loss,
                              dataset=base.dataset, global_batch_size=64,
                              micro_batch_size=16, grad_clip_norm=base.grad_clip_norm)
    job = Job(spec, RunConfig(steps=6, replicas=3, run_dir=tmp_path, ledger=True,
                              overlap_reduction=True))
    with job:
        # w1 (one micro-batch) dies once its gradient is computed: w0 (two) is then in its
        # last backward, whose hooks reduce the buckets as they complete.
        install(job, "w1", SignalSelfAt(3, "computed", 9, str(tmp_path / "fired")))
        run_to(job, 6)
    kinds = [f["kind"] for f in of(events(tmp_path), "fault")]
    assert kinds == ["worker_lost"], kinds
    assert_exactly_once(tmp_path, num_samples=512, global_batch_size=64, steps=6)
