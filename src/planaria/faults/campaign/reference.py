"""The independent reference: the spec trained by a plain single-process PyTorch loop.

No controller, no workers, no collective, no Ray: one process builds what a
worker builds, from the same seeds (:mod:`planaria.data.randomness`: every factory
with the global generators seeded from ``factory_seed(seed, name)``), and
trains over the same data plan (:class:`planaria.data.plan.DataPlan`). Per step:

- the step's batch, cut into its micro-batches in order (micro-batch ``j``
  holds batch positions ``[j*mbs, (j+1)*mbs)``), every sample served inside
  its sample scope (:func:`planaria.data.randomness.serve_samples`) and collated;
- for each micro-batch, torch's generator seeded from
  ``micro_batch_seed(seed, step, j)``, the loss, and ``loss * n / global_batch``
  backward (``n`` the micro-batch's samples), the gradients accumulating in
  zero-initialised ``.grad`` tensors (a worker binds every parameter's gradient
  to a zeroed buffer, so an optimizer sees a zero gradient, never None);
- the global L2 norm of the gradients (per dtype, as one flat vector),
  clipping by ``min(1, clip / (norm + 1e-6))`` when it is finite, the
  optimizer's step, the scheduler's step, the gradients zeroed.

BatchNorm's running statistics evolve as one process running the micro-batches
in order makes them, which is what planaria's buffer composition reproduces at
any width (:mod:`planaria.worker.buffers`).

A sample the run skipped (a ``bad_sample`` fault with the skip policy) is left
out of its micro-batch, from the step it was armed for on: that micro-batch is
one sample smaller, and its loss weighs ``n / global_batch`` with the smaller
``n``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from planaria.data.plan import DataPlan
from planaria.data.randomness import (
    factory_seed,
    micro_batch_seed,
    seed_globals,
    seed_torch,
    serve_samples,
)
from planaria.faults.errors import ConfigError

__all__ = ["train_reference"]


def _factory(name: str, seed: int, fn: Any, *args: Any) -> Any:
    seed_globals(factory_seed(seed, name))
    return fn(*args)


def _global_norm(params: list[torch.nn.Parameter]) -> float:
    """The gradients' L2 norm, one flat vector per dtype (a worker's gradient buffers)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        assert p.grad is not None
        by_dtype.setdefault(p.dtype, []).append(p.grad.reshape(-1))
    squares = []
    for dtype, grads in by_dtype.items():
        flat = torch.cat(grads)
        squares.append(flat.dot(flat).double() if dtype in (torch.float32, torch.float64)
                       else torch.linalg.vector_norm(flat.float()).double().square())
    return float(torch.stack(squares).sum().sqrt()) if squares else 0.0


def train_reference(
    spec: Any,
    counts: Iterable[int],
    *,
    skip: Mapping[int, int] | None = None,
) -> dict[int, dict[str, torch.Tensor]]:
    """The model's state dict after each of ``counts`` steps (copies, on the CPU).

    ``skip`` maps a sample id to the first step from which it is left out of its
    micro-batch (see the module docstring)."""
    if spec.precision == "fp16" or spec.compile:
        raise ConfigError(
            "the campaign's reference trains in full precision (or bf16) without torch.compile: "
            f"precision={spec.precision!r}, compile={spec.compile!r} are not supported")
    wanted = sorted(set(int(c) for c in counts))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small model: more threads only contend (a worker runs one)
    try:
        return _train(spec, wanted, dict(skip or {}))
    finally:
        torch.set_num_threads(threads)


def _train(
    spec: Any, wanted: list[int], skip: dict[int, int]
) -> dict[int, dict[str, torch.Tensor]]:
    seed = spec.seed
    model = _factory("model", seed, spec.model)
    optimizer = _factory("optimizer", seed, spec.optimizer, model.parameters())
    scheduler = (_factory("lr_scheduler", seed, spec.lr_scheduler, optimizer)
                 if spec.lr_scheduler else None)
    dataset = _factory("dataset", seed, spec.dataset)
    if spec.collate is not None:
        collate = spec.collate
    else:
        from torch.utils.data import default_collate

        collate = default_collate
    plan = DataPlan(len(dataset), spec.global_batch_size, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    gbs, mbs = spec.global_batch_size, spec.micro_batch_size
    out: dict[int, dict[str, torch.Tensor]] = {}
    if 0 in wanted:
        out[0] = _copy(model)
    for step in range(max(wanted, default=0)):
        ids = [int(i) for i in plan.batch(step)]
        batches = []
        for j in range(gbs // mbs):
            chunk = [i for i in ids[j * mbs:(j + 1) * mbs]
                     if i not in skip or step < skip[i]]
            samples = serve_samples(seed, step, dataset.__getitem__, chunk)
            batches.append((len(chunk), collate(samples)))
        model.train()
        for j, (n, batch) in enumerate(batches):
            seed_torch(micro_batch_seed(seed, step, j))
            with _autocast(spec):
                result = spec.loss(model, batch)
            loss = result[0] if isinstance(result, tuple) else result
            (loss * (n / gbs)).backward()
        norm = _global_norm(params)
        if not math.isfinite(norm):
            raise ConfigError(f"the reference's gradient is not finite at step {step}: {norm}")
        clip = spec.grad_clip_norm
        if clip is not None:
            coef = min(1.0, clip / (norm + 1e-6))
            if coef < 1.0:
                for p in params:
                    assert p.grad is not None
                    p.grad.mul_(coef)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        for p in params:
            assert p.grad is not None
            p.grad.zero_()
        if step + 1 in wanted:
            out[step + 1] = _copy(model)
    return out


def _copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _autocast(spec: Any) -> Any:
    import contextlib

    if spec.precision is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16)
