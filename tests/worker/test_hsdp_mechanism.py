"""The mechanism sharded replicas are to be built on, checked in this torch: FSDP2 inside a
replica over a mesh made from the replica's own group, and the gradient of each shard summed
across replicas over a group of the workers holding that shard index (2 replicas x 2 shards,
gloo). Trained so, the weights equal one process's on the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

REPLICAS, SHARDS, STEPS, BATCH = 2, 2, 3, 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def _train(rank: int, world: int, store_path: str, out: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    replica, shard = divmod(rank, SHARDS)
    intra = [dist.new_group([r * SHARDS + s for s in range(SHARDS)]) for r in range(REPLICAS)]
    cross = [dist.new_group([r * SHARDS + s for r in range(REPLICAS)]) for s in range(SHARDS)]
    model = _model()
    mesh = DeviceMesh.from_group(intra[replica], device_type="cpu")
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_gradient_divide_factor(1.0)  # sums inside the replica
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x, y = _data()
    share = BATCH // world
    for _ in range(STEPS):
        part = slice(rank * share, (rank + 1) * share)
        ((model(x[part]) - y[part]) ** 2).sum().backward()
        for p in model.parameters():
            grad = p.grad.to_local()  # this worker's shard of the replica's summed gradient
            dist.all_reduce(grad, group=cross[shard])  # ... summed over the replicas
            grad /= BATCH
        opt.step()
        opt.zero_grad()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    local = {n: p.to_local().numel() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"full": full, "local": local}, out)
    dist.destroy_process_group()


def test_fsdp2_in_a_replica_with_per_shard_index_reduction_across_replicas(tmp_path):
    out = tmp_path / "weights.pt"
    mp.spawn(_train, args=(REPLICAS * SHARDS, str(tmp_path / "store"), str(out)),
             nprocs=REPLICAS * SHARDS)
    got = torch.load(out)
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    x, y = _data()
    for _ in range(STEPS):
        (((ref(x) - y) ** 2).sum() / BATCH).backward()
        opt.step()
        opt.zero_grad()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got["full"][name], p.detach(), atol=1e-5, rtol=1e-4)
        assert got["local"][name] == p.numel() // SHARDS  # each worker holds half
