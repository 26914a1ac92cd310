"""Randomness that does not depend on the width: every stream is derived from the spec's seed.

- Before each user factory (model, optimizer, scheduler, dataset) a worker seeds
  Python's, numpy's and torch's global generators from ``(seed, factory)``, so
  every replica builds the same objects.
- Before micro-batch j of step s (j its index in the global batch) a worker
  seeds torch's generators (CPU and CUDA) from ``(seed, s, j)``: dropout masks
  are the same whichever rank runs the micro-batch and however many there are.
- While the loader calls ``dataset[i]`` for step s, :func:`sample_seed` and
  :func:`sample_generator` give a stream derived from ``(seed, s, i)``.
- A dataset may draw from the global generators instead (torchvision-style
  ``x + 0.1 * torch.randn_like(x)``, ``np.random``, ``random``): a worker finds
  out at setup (:func:`probe_sample`: the generators' states before and after
  ``dataset[i]``) and then serves every sample with the three generators seeded
  from :func:`sample_seed` and the caller's states put back after the
  micro-batch (:func:`serve_samples` with ``reseed=True``). The global
  generators are shared by the threads of the process, so such a dataset loads
  on the training thread only (no loader thread).
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from planaria.faults.errors import PlanariaError

__all__ = [
    "GENERATORS",
    "GlobalStates",
    "current_sample",
    "derive_seed",
    "drawn_from",
    "eval_batch_seed",
    "factory_seed",
    "micro_batch_seed",
    "probe_sample",
    "sample_generator",
    "sample_scope",
    "sample_seed",
    "seed_globals",
    "seed_sample_globals",
    "seed_torch",
    "serve_samples",
]

# Domain tags keep the streams apart: a factory's seed never equals a micro-batch's.
_FACTORY, _MICRO_BATCH, _SAMPLE, _EVAL_BATCH = 1, 2, 3, 4
FACTORIES = ("model", "optimizer", "lr_scheduler", "dataset", "eval_dataset")

GENERATORS = ("torch", "torch.cuda", "numpy", "random")
"""The global generators a dataset may draw from: torch's CPU generator, the CUDA
generators (where this process initialised CUDA), numpy's legacy global ``RandomState``
(``np.random.*``) and Python's ``random``."""

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


def eval_batch_seed(seed: int, step: int, index: int) -> int:
    """The seed of eval batch ``index`` of the evaluation after ``step`` committed steps."""
    return derive_seed(_EVAL_BATCH, seed, step, index)


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
    seed: int, step: int, getitem: Callable[[int], Any], ids: list[int], reseed: bool = False
) -> list[Any]:
    """``[getitem(i) for i in ids]``, each inside its :func:`sample_scope` (one loop, no
    context manager a sample: this runs for every sample of every step). An error names the
    sample it was raised for.

    ``reseed`` (a dataset that draws from the global generators, see :func:`probe_sample`):
    before each sample the global generators are seeded from its :func:`sample_seed`, and
    the caller's states are put back once the samples are served, so the caller's own
    streams go on as if nothing had drawn from them. The generators are the process's: call
    it with ``reseed`` on the thread that owns them (the training thread), never beside it.
    """
    previous = getattr(_current, "key", None)
    saved = GlobalStates.save() if reseed else None
    samples = []
    i = -1
    try:
        for i in ids:
            _current.key = (seed, step, i)
            if saved is not None:
                seed_sample_globals(derive_seed(_SAMPLE, seed, step, i))
            samples.append(getitem(i))
    except Exception as err:
        err.add_note(f"(planaria: loading sample {i} of step {step})")
        err.planaria_sample = i  # type: ignore[attr-defined]  # the work that failed
        raise
    finally:
        _current.key = previous
        if saved is not None:
            saved.restore()
    return samples


def probe_sample(
    seed: int, step: int, getitem: Callable[[int], Any], i: int
) -> tuple[Any, tuple[str, ...]]:
    """``(getitem(i), drawn)``: the sample, served with the global generators seeded from
    its :func:`sample_seed`, and the names of the generators it drew from
    (:data:`GENERATORS`), found by comparing their states before and after the call. The
    caller's states are put back. For setup, where nothing else runs in the process."""
    saved = GlobalStates.save()
    try:
        with sample_scope(seed, step, i):
            seed_sample_globals(sample_seed())
            seeded = GlobalStates.save()
            sample = getitem(i)
        return sample, drawn_from(seeded, GlobalStates.save())
    finally:
        saved.restore()


@dataclass(frozen=True)
class GlobalStates:
    """The states of the global generators (:data:`GENERATORS`) at one moment.

    Saving and restoring all of them costs ~0.1 ms (numpy's state alone ~80 us of it: its
    ``get_state``/``set_state`` copy 2.5 KB through Python objects); seeding all of them,
    ~10 us."""

    torch_cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] | None
    numpy: Any  # np.random.get_state(): ("MT19937", keys, pos, has_gauss, gauss)
    python: tuple[Any, ...]

    @staticmethod
    def save() -> GlobalStates:
        cuda = (tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized()
                else None)
        return GlobalStates(torch.default_generator.get_state(), cuda,
                            np.random.get_state(), random.getstate())

    def restore(self) -> None:
        torch.default_generator.set_state(self.torch_cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(list(self.cuda))
        np.random.set_state(self.numpy)
        random.setstate(self.python)


def drawn_from(before: GlobalStates, after: GlobalStates) -> tuple[str, ...]:
    """The names of the generators (:data:`GENERATORS`) whose state differs."""
    out = []
    if not torch.equal(before.torch_cpu, after.torch_cpu):
        out.append("torch")
    if (before.cuda is None) != (after.cuda is None) or (
        before.cuda is not None and after.cuda is not None
        and any(not torch.equal(a, b) for a, b in zip(before.cuda, after.cuda, strict=True))
    ):
        out.append("torch.cuda")
    a, b = before.numpy, after.numpy
    if a[0] != b[0] or not np.array_equal(a[1], b[1]) or a[2:] != b[2:]:
        out.append("numpy")
    if before.python != after.python:
        out.append("random")
    return tuple(out)


def seed_sample_globals(seed: int) -> None:
    """Seeds the global generators (:data:`GENERATORS`) for one sample: torch (CPU, and
    CUDA where initialised), numpy's and Python's. Like :func:`seed_globals`, without
    ``torch.manual_seed``'s deferred CUDA seeding (see :func:`seed_torch`)."""
    seed_torch(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def current_sample() -> tuple[int, int, int] | None:
    """``(seed, step, sample_id)`` of the sample this thread loads now (its sample scope),
    else None."""
    key: tuple[int, int, int] | None = getattr(_current, "key", None)
    return key


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
