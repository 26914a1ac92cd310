"""The specs a campaign trains: the examples on small datasets, or the user's script.

A run's spec is drawn from :data:`CAMPAIGN_SPECS` (``mlp``, ``bn_mlp`` with
BatchNorm and dropout, ``tiny_gpt`` with dropout), each on a dataset small
enough that a run crosses an epoch boundary within its first steps, and with
eight micro-batches a step (room for four replicas of two workers each); or it
is the user's ``SCRIPT.py[:SPEC]``. Either way the dataset is wrapped in the
campaign's :class:`~planaria.faults.campaign.dataset.CampaignData` (the load record,
the sample faults).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from planaria.cli.spec_file import load_spec
from planaria.faults.campaign.dataset import CampaignData

__all__ = ["CAMPAIGN_SPECS", "build_spec", "has_buffers", "is_campaign_spec"]

CAMPAIGN_SPECS = ("mlp", "bn_mlp", "tiny_gpt")
EPOCH_STEPS = 10
"""Steps per epoch of the campaign's own specs: every run crosses at least one boundary."""


def is_campaign_spec(name: str) -> bool:
    return name in CAMPAIGN_SPECS


def _example(name: str) -> tuple[Any, int | None]:
    """The example's spec and the dataset size to cut it to (None: its own)."""
    if name == "mlp":
        from planaria.examples import mlp

        return mlp.make_spec(n=64 * EPOCH_STEPS, micro_batch_size=8), None
    if name == "bn_mlp":
        from planaria.examples import bn_mlp

        return bn_mlp.make_spec(n=64 * EPOCH_STEPS, micro_batch_size=8, dropout=0.2), None
    if name == "tiny_gpt":
        from planaria.examples import tiny_gpt

        spec = tiny_gpt.make_spec(global_batch_size=32, micro_batch_size=4, dim=64, layers=2,
                                  dropout=0.1)
        spec = dataclasses.replace(spec, model=_TinyGPTWithoutAttentionBias(64, 2, 0.1))
        return spec, 32 * EPOCH_STEPS  # its corpus has ~56,000 windows: the first 320 of them
    raise ValueError(f"spec={name!r} is not valid: one of {', '.join(CAMPAIGN_SPECS)} or "
                     "SCRIPT.py[:SPEC]")


class _TinyGPTWithoutAttentionBias:
    """The example's TinyGPT, its attention without biases. The key projection's bias has a
    gradient of zero up to rounding (softmax ignores a shift of every score), which Adam
    amplifies into steps of size lr: runs that differ only in summation order (another
    width, the reference) drift apart there (as ``bn_mlp`` drops the bias before a
    BatchNorm for the same reason)."""

    def __init__(self, dim: int, layers: int, dropout: float) -> None:
        self.dim, self.layers, self.dropout = dim, layers, dropout

    def __call__(self) -> Any:
        from torch import nn

        from planaria.examples.tiny_gpt import TinyGPT

        model = TinyGPT(dim=self.dim, layers=self.layers, dropout=self.dropout)
        for block in model.blocks:
            attn: Any = block.attn
            block.attn = nn.MultiheadAttention(attn.embed_dim, attn.num_heads,
                                               dropout=self.dropout, batch_first=True,
                                               bias=False)
        return model


def build_spec(target: str, *, control: str | None) -> Any:
    """The spec ``target`` names (a campaign spec or ``SCRIPT.py[:SPEC]``), its dataset
    wrapped in the campaign's (recording its loads into ``control``; None: no record)."""
    if is_campaign_spec(target):
        spec, limit = _example(target)
    else:
        spec, limit = load_spec(target), None
    return dataclasses.replace(spec, dataset=CampaignData(spec.dataset, control=control,
                                                          limit=limit))


def has_buffers(spec: Any) -> bool:
    """Whether the spec's model has persistent buffers (BatchNorm): sharded replicas refuse it."""
    model = spec.model()
    params = {name for name, _ in model.named_parameters()}
    return any(name not in params for name in model.state_dict())
