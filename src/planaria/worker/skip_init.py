"""A joiner's model built without its random initialisation.

A joiner (a replacement, a spare) builds the model only to have somewhere to put the state
it is sent or restores: every parameter is overwritten before its first step, and a start
over from step 0 builds the state again (``Worker.reinit``). Drawing the initial weights is
then wasted CPU, taken from the training steps beside it on a shared node: 0.45 CPU-s of
a spare's 0.9 at the ``realistic`` size of ``bench/common.py`` (82M embedding parameters,
``normal_``). :func:`initialisation_skipped` leaves ``torch.nn.init``'s functions (what
``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``... call from ``reset_parameters``) doing
nothing while the factory runs, as transformers' ``no_init_weights`` does, and
:func:`zero_parameters` then gives every parameter a defined value (the memory is touched
once either way: here or when the state is copied in), so the warm-up's forward and
backward see finite numbers. Buffers are not touched: a module computes them itself
(BatchNorm's statistics, a rotary table), and a non-persistent one, which no transfer
carries, stays as its ``__init__`` made it. ``RunConfig(joiner_skips_init=False)`` turns it
off for a model whose ``__init__`` uses ``torch.nn.init`` for something its ``state_dict``
does not hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn import init

__all__ = ["INIT_FUNCTIONS", "initialisation_skipped", "zero_parameters"]

INIT_FUNCTIONS = tuple(
    name for name in (
        "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
        "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
        "orthogonal_", "sparse_",
        # the deprecated spellings without the underscore
        "uniform", "normal", "constant", "eye", "dirac", "xavier_uniform", "xavier_normal",
        "kaiming_uniform", "kaiming_normal", "orthogonal", "sparse",
    ) if hasattr(init, name))


def _left_as_is(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def initialisation_skipped() -> Iterator[None]:
    """``torch.nn.init``'s functions return their tensor untouched inside (this process,
    every thread: run the factory alone in it), as they were after."""
    saved = {name: getattr(init, name) for name in INIT_FUNCTIONS}
    for name in saved:
        setattr(init, name, _left_as_is)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def zero_parameters(model: torch.nn.Module) -> None:
    """Every parameter 0 (whatever the skipped initialisation left in its memory)."""
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
