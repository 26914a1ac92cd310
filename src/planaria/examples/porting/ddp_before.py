"""A plain torchrun + DDP + DataLoader training script, as users write it (the "before" of
docs/porting.md). Run: torchrun --nproc-per-node 3 ddp_before.py"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

STEPS, GLOBAL_BATCH = 200, 48


def make_dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    return TensorDataset(x, x @ torch.randn(32, 1, generator=g))


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // world, sampler=sampler)
    model = DDP(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    step, epoch = 0, 0
    while step < STEPS:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"step {step} loss {loss.item():.4f}")
            if step == STEPS:
                break
        epoch += 1
    if rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
