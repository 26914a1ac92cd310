"""Evaluation, as both sides see it: the eval set's batches, a replica's report, the result.

The eval set of ``num_samples`` samples is cut into fixed batches of ``batch_size`` by
index (batch j holds ``[j*batch_size, (j+1)*batch_size)``, the last one maybe shorter),
whatever the width; batch j runs on the live replica of place ``j % width``
(:func:`eval_batches`). A replica answers each batch's figures (:class:`EvalBatch`) in an
:class:`EvalReport`; the controller combines them, in batch order, into an
:class:`EvalResult` (:mod:`planaria.control.evaluation`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["EvalBatch", "EvalReport", "EvalResult", "eval_batches", "num_eval_batches"]


def num_eval_batches(num_samples: int, batch_size: int) -> int:
    """How many batches the eval set is cut into (the last one may be shorter)."""
    return -(-num_samples // batch_size)


def eval_batches(num_samples: int, batch_size: int, place: int, width: int
                 ) -> list[tuple[int, range]]:
    """``(j, sample ids)`` of every batch the replica of place ``place`` (of ``width``)
    runs: those with ``j % width == place``, in order."""
    if not 0 <= place < width:
        raise ValueError(f"place {place} is not among {width} replicas")
    return [(j, range(j * batch_size, min((j + 1) * batch_size, num_samples)))
            for j in range(place, num_eval_batches(num_samples, batch_size), width)]


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalBatch:
    """One eval batch's figures: its index ``index``, its ``samples``, and each metric's
    mean over them, as the user's ``evaluate`` returned it (floats)."""

    index: int
    samples: int
    metrics: Mapping[str, float]


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalReport:
    """A replica's answer to an evaluation: its batches' figures in batch order, the size
    of the eval set it built (every replica's must agree) and the steps it had applied."""

    batches: Sequence[EvalBatch]
    num_samples: int
    steps_done: int

    @staticmethod
    def merge(mine: EvalReport, theirs: Sequence[EvalReport]) -> EvalReport:
        """A sharded replica's: every worker ran the same batches; the leader's figures."""
        return mine


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """An evaluation of the committed state: after ``step`` committed steps, each metric's
    sample-weighted mean over the whole eval set (``samples`` samples), in ``seconds``."""

    step: int
    metrics: dict[str, float]
    samples: int
    seconds: float
