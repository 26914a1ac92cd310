"""What the workers answer the controller's calls: one frozen dataclass per report.

A worker builds the report of each call it answers; the controller reads it. A sharded
replica's workers each build their own, and the replica's leader merges them into the
replica's with the report's ``merge`` (the leader's first, then the others' in shard order),
so the controller reads the same report whatever the number of workers per replica
(:mod:`planaria.replica`).

Every report crosses a process boundary by Ray's serialisation: the classes live here, in
the package both sides import, and hold plain values only (numbers, strings, tuples and
mappings of them), never tensors or handles.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "Attempt",
    "Hold",
    "Joined",
    "RunEnd",
    "RunReport",
    "Served",
    "Settled",
    "StepRecord",
    "merge_checksums",
]


def merge_checksums(mine: int, theirs: Sequence[int]) -> int:
    """One checksum for a replica: its shards' checksums, in shard order."""
    return zlib.crc32(b"".join(int(c).to_bytes(8, "little") for c in [mine, *theirs]))


def _sums(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0.0) + value
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Served:
    """What one rank's dataset served for a step: the ids ``dataset[i]`` was called with, in
    order, and their content digests (``None`` where a part of the replica kept none)."""

    ids: tuple[int, ...]
    digests: tuple[int, ...] | None

    @staticmethod
    def merge(parts: Sequence[Served]) -> Served:
        """A replica's: every worker's ids in shard order; digests only if every one has them."""
        digests = [p.digests for p in parts]
        return Served(
            ids=tuple(i for p in parts for i in p.ids),
            digests=None if any(d is None for d in digests)
            else tuple(d for ds in digests if ds is not None for d in ds),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Attempt:
    """A step attempt's samples on one worker, kept until the step commits: a survivor of a
    failed step reports it when it joins the next generation (the ledger's ``served``)."""

    gen: int
    step: int
    served: Served


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRecord:
    """One rank's record of a step it ran: its own part (``loss_sum``, ``samples``,
    ``metric_sums``, ``served``) and the step's totals over every rank (``global_*``, known
    to every rank once the step's reduction completed).

    ``finite`` is False when the loss or the reduced gradient is not finite (the step was
    not applied: the controller's policy decides); ``overflow`` when a loss scaler's scale
    was too high (every replica skipped the update alike). ``leaving``: some rank got a
    preemption notice by this step."""

    step: int
    worker: str
    t0: float
    """When the step started (Unix time)."""
    t: float
    """When it was applied, or found not finite (Unix time)."""
    grad_norm: float
    overflow: bool
    finite: bool
    loss_sum: float
    samples: int
    metric_sums: Mapping[str, float]
    served: Served
    data_wait_s: float
    compute_s: float
    reduce_s: float
    preempting: bool
    leaving: bool
    global_loss_sum: float
    global_samples: int
    global_metric_sums: Mapping[str, float]

    @property
    def loss(self) -> float:
        """The step's mean loss over every rank's samples (NaN with none)."""
        n = self.global_samples
        return self.global_loss_sum / n if n else float("nan")

    def streamed(self) -> dict[str, object]:
        """The fields the leader publishes while its run goes on (JSON)."""
        return {"step": self.step, "t0": self.t0, "t": self.t,
                "global_loss_sum": self.global_loss_sum, "global_samples": self.global_samples,
                "global_metric_sums": dict(self.global_metric_sums),
                "grad_norm": self.grad_norm, "overflow": self.overflow,
                "data_wait_s": self.data_wait_s, "finite": self.finite}

    def with_parts(self, parts: Sequence[StepRecord]) -> StepRecord:
        """This record (the leader's) with the replica's other workers' records of the same
        step merged in: what every worker was served, and the sums of their own metrics."""
        everyone = [self, *parts]
        return replace(self, served=Served.merge([p.served for p in everyone]),
                       metric_sums=_sums([p.metric_sums for p in everyone]))


def merge_records(
    mine: Sequence[StepRecord], theirs: Sequence[Sequence[StepRecord]]
) -> tuple[StepRecord, ...]:
    """The leader's step records, each with the others' records of its step merged in where
    they came back (a worker returns only the records it has)."""
    by_step = [{r.step: r for r in recs} for recs in theirs]
    return tuple(rec.with_parts([s[rec.step] for s in by_step if rec.step in s])
                 for rec in mine)


RunEnd = Literal["until", "stop", "leaving", "nonfinite"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunReport:
    """How a run of steps ended (``Worker.run``): ``until`` (it reached its end), ``stop``
    (the controller asked), ``leaving`` (a preemption notice), ``nonfinite``. ``steps``: the
    records of the steps it ran (rank 0 returns all; other ranks their last, or all with a
    ledger)."""

    steps: tuple[StepRecord, ...]
    ended: RunEnd
    steps_done: int
    preempting: bool

    def merge(self, theirs: Sequence[RunReport]) -> RunReport:
        return replace(self, steps=merge_records(self.steps, [t.steps for t in theirs]),
                       preempting=self.preempting or any(t.preempting for t in theirs))


@dataclass(frozen=True, kw_only=True, slots=True)
class Settled:
    """A worker after a failed run (``Worker.settle_run``): how far it got, and the records
    of the steps it applied in that run."""

    steps_done: int
    steps: tuple[StepRecord, ...]

    def merge(self, theirs: Sequence[Settled]) -> Settled:
        return replace(self, steps=merge_records(self.steps, [t.steps for t in theirs]))


@dataclass(frozen=True, kw_only=True, slots=True)
class Joined:
    """A worker that entered a generation (``Worker.join``): its steps done, and what a step
    attempt it dropped there had been served (for the ledger), if any."""

    steps_done: int
    dropped: Attempt | None

    def merge(self, theirs: Sequence[Joined]) -> Joined:
        if self.dropped is None:
            return self
        parts = [self.dropped.served, *(t.dropped.served for t in theirs if t.dropped)]
        return replace(self, dropped=replace(self.dropped, served=Served.merge(parts)))


@dataclass(frozen=True, kw_only=True, slots=True)
class Hold:
    """A worker held at a step boundary for a save beside a run (``ckpt_freeze``,
    ``ckpt_advance``): its steps done, and whether its pending step's reduction completed."""

    steps_done: int
    reduced: bool

    def merge(self, theirs: Sequence[Hold]) -> Hold:
        """A replica is as far as its least advanced worker."""
        parts = [self, *theirs]
        return Hold(steps_done=min(p.steps_done for p in parts),
                    reduced=all(p.reduced for p in parts))
