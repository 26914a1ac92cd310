"""Randomness that does not depend on the width: every stream is derived from the spec's seed.

- Before each user factory (model, optimizer, scheduler, dataset) a worker seeds
  Python's, numpy's and torch's global generators from ``(seed, factory)``, so
  every replica builds the same objects.
- Before micro-batch j of step s (j its index in the global batch) a worker
  seeds torch's generators (CPU and CUDA) from ``(seed, s, j)``: dropout masks
  are the same whichever rank runs the micro-batch and however many there are.
- While the loader calls ``dataset[i]`` for step s, :func:`sample_seed` and
  :func:`sample_generator` give a stream derived from ``(seed, s, i)``. The loader
  runs in a background thread while the previous step computes, so a dataset
  must not draw from the global generators (they are shared by the threads of
  the process); random augmentation draws from :func:`sample_generator`.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from planaria.errors import PlanariaError

__all__ = [
    "derive_seed",
    "factory_seed",
    "micro_batch_seed",
    "sample_generator",
    "sample_scope",
    "sample_seed",
    "seed_globals",
    "seed_torch",
    "serve_samples",
]

# Domain tags keep the streams apart: a factory's seed never equals a micro-batch's.
_FACTORY, _MICRO_BATCH, _SAMPLE = 1, 2, 3
FACTORIES = ("model", "optimizer", "lr_scheduler", "dataset")

_current = threading.local()


def derive_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (numpy's SeedSequence: nearby inputs, unrelated seeds)."""
    words = [int(p) % 2**64 for p in parts]
    state = np.random.SeedSequence(words).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def factory_seed(seed: int, factory: str) -> int:
    return derive_seed(_FACTORY, seed, FACTORIES.index(factory))


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """The seed of micro-batch ``index`` (its place in the global batch) of step ``step``."""
    return derive_seed(_MICRO_BATCH, seed, step, index)


def seed_globals(seed: int) -> None:
    """Seeds Python's, numpy's and torch's (CPU and CUDA) global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_torch(seed: int) -> None:
    """Seeds torch's CPU generator, and the CUDA generators if this process uses CUDA: what
    ``torch.manual_seed`` does for a worker's streams, without its deferred CUDA seeding.
    Where CUDA is not initialized (a CPU worker) ``torch.manual_seed`` defers the CUDA
    seeding and formats the caller's stack trace to go with it, every call: ~0.5 ms a
    micro-batch under Ray's deep stacks (13% of the tiny bench model's step)."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


@contextlib.contextmanager
def sample_scope(seed: int, step: int, sample_id: int) -> Iterator[None]:
    """Makes :func:`sample_seed` answer for sample ``sample_id`` of step ``step`` (this thread)."""
    previous = getattr(_current, "key", None)
    _current.key = (seed, step, sample_id)  # derived only if the dataset asks (it costs ~10 us)
    try:
        yield
    finally:
        _current.key = previous


def serve_samples(
    seed: int, step: int, getitem: Callable[[int], Any], ids: list[int]
) -> list[Any]:
    """``[getitem(i) for i in ids]``, each inside its :func:`sample_scope` (one loop, no
    context manager a sample: this runs for every sample of every step). An error names the
    sample it was raised for."""
    previous = getattr(_current, "key", None)
    samples = []
    i = -1
    try:
        for i in ids:
            _current.key = (seed, step, i)
            samples.append(getitem(i))
    except Exception as err:
        err.add_note(f"(planaria: loading sample {i} of step {step})")
        err.planaria_sample = i  # type: ignore[attr-defined]  # the work that failed
        raise
    finally:
        _current.key = previous
    return samples


def sample_seed() -> int:
    """Inside ``dataset[i]`` in a worker: a seed for this sample in this step.

    The same for a sample whichever rank loads it and at any width; it changes
    from step to step (a new augmentation each epoch).
    """
    key = getattr(_current, "key", None)
    if key is None:
        raise PlanariaError(
            "sample_seed() is only defined while a planaria worker loads a sample (dataset[i])"
        )
    return derive_seed(_SAMPLE, *key)


def sample_generator() -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`sample_seed`, for random augmentation."""
    return torch.Generator().manual_seed(sample_seed())
