"""What the workers answer the controller's calls: one frozen dataclass per report.

A worker builds the report of each call it answers; the controller reads it. A sharded
replica's workers each build their own, and the replica's leader merges them into the
replica's with the report's ``merge`` (the leader's first, then the others' in shard order),
so the controller reads the same report whatever the number of workers per replica
(:mod:`planaria.worker.replica`).

Every report crosses a process boundary by Ray's serialisation: the classes live here, in
the package both sides import, and hold plain values only (numbers, strings, sequences and
mappings of them), never tensors or handles. Two reports also cross the controller's store
as JSON, converted here and nowhere else: the step totals rank 0 streams while a run goes
on (:func:`stream_chunk`) and a rank's served samples written to the run's ledger key
before each step's collective (:func:`served_line`).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "RANK_PARTS",
    "Attempt",
    "CarriedStep",
    "HeldWork",
    "Hold",
    "Joined",
    "RankTimes",
    "RunEnd",
    "RunReport",
    "Served",
    "Settled",
    "StepRecord",
    "StepTotals",
    "merge_checksums",
    "merge_records",
    "merge_sum",
    "read_served_lines",
    "read_stream_chunk",
    "served_line",
    "stream_chunk",
]


def merge_checksums(mine: int, theirs: Sequence[int]) -> int:
    """One checksum for a replica: its shards' checksums, in shard order."""
    return zlib.crc32(b"".join(int(c).to_bytes(8, "little") for c in [mine, *theirs]))


def merge_sum(mine: int, theirs: Sequence[int]) -> int:
    """A replica's count (of bytes sent, received): its workers' summed."""
    return mine + sum(theirs)


def _sums(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0.0) + value
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Served:
    """What one rank's dataset served for a step: the ids ``dataset[i]`` was called with, in
    order, and their content digests (None when digests are not recorded)."""

    ids: Sequence[int]
    digests: Sequence[int] | None

    @staticmethod
    def merge(parts: Sequence[Served]) -> Served:
        """A replica's: every worker's ids in shard order; digests only if every one has them."""
        digests = [p.digests for p in parts]
        return Served(
            ids=tuple(i for p in parts for i in p.ids),
            digests=None if any(d is None for d in digests)
            else tuple(d for ds in digests if ds is not None for d in ds),
        )


def served_line(step: int, worker: str, served: Served) -> str:
    """``served`` as one line of a run's ledger key (JSON, see :func:`read_served_lines`)."""
    digests = None if served.digests is None else [int(d) for d in served.digests]
    return json.dumps({"step": step, "worker": worker, "ids": [int(i) for i in served.ids],
                       "digests": digests}) + "\n"


def read_served_lines(text: str) -> Iterator[tuple[int, str, Served]]:
    """``(step, worker, served)`` of each line :func:`served_line` wrote."""
    for line in text.splitlines():
        if line:
            rec = json.loads(line)
            digests = rec.get("digests")
            yield (int(rec["step"]), str(rec["worker"]),
                   Served(ids=[int(i) for i in rec["ids"]],
                          digests=None if digests is None else [int(d) for d in digests]))


@dataclass(frozen=True, kw_only=True, slots=True)
class Attempt:
    """A step attempt's samples on one worker, kept until the step commits: a survivor of a
    failed step reports it when it joins the next generation (for the ledger)."""

    gen: int
    step: int
    served: Served


RANK_PARTS = ("load", "compute", "reduce_wait", "apply")
"""Where a rank's step time goes (:class:`RankTimes`), in this order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankTimes:
    """Where a step's time went on each rank, in seconds, rank order from rank ``first`` (a
    wide job's step carries a page of its ranks: see :mod:`planaria.worker.rank_times`):
    ``load`` (waiting for its samples, and loading them ahead during the previous step's
    reduction), ``compute`` (forward and backward), ``reduce_wait`` (blocked in the
    gradient's all-reduce: the peers' lateness), ``apply`` (the optimizer step and the
    bookkeeping until the next step starts). NaN where not known: the reduce-wait and
    apply of a run's last step, which the next step's status would have carried."""

    first: int
    load: tuple[float, ...]
    compute: tuple[float, ...]
    reduce_wait: tuple[float, ...]
    apply: tuple[float, ...]

    def to_json(self) -> dict[str, object]:
        """``{"load": [...], ..., "first": N}`` (``first`` only when not 0; null for NaN)."""
        out: dict[str, object] = {
            part: [None if math.isnan(v) else round(v, 6) for v in getattr(self, part)]
            for part in RANK_PARTS}
        if self.first:
            out["first"] = self.first
        return out

    @staticmethod
    def from_json(raw: Mapping[str, object]) -> RankTimes:
        """What :meth:`to_json` wrote."""
        def part(name: str) -> tuple[float, ...]:
            values = raw.get(name) or ()
            assert isinstance(values, (list, tuple))
            return tuple(math.nan if v is None else float(v) for v in values)

        first = raw.get("first") or 0
        assert isinstance(first, (int, float))
        return RankTimes(first=int(first), load=part("load"), compute=part("compute"),
                         reduce_wait=part("reduce_wait"), apply=part("apply"))


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTotals:
    """A step as every rank knows it once its reduction completed: what the controller
    commits it from. ``finite`` is False when the loss or the reduced gradient is not finite
    (the step was not applied: the controller's policy decides); ``overflow`` when a loss
    scaler's scale was too high (every replica skipped the update alike)."""

    step: int
    t0: float
    """When the step started (Unix time)."""
    t: float
    """When it was applied, or found not finite (Unix time)."""
    grad_norm: float
    overflow: bool
    finite: bool
    data_wait_s: float
    """How long rank 0 waited for its samples."""
    global_loss_sum: float
    global_samples: int
    global_metric_sums: Mapping[str, float]
    lr: float = math.nan
    """The learning rate the step was applied with (the optimizer's first parameter group)."""
    ranks: RankTimes | None = None
    """Where the step's time went on each rank (None: not carried)."""

    @property
    def loss(self) -> float:
        """The step's mean loss over every rank's samples (NaN with none)."""
        n = self.global_samples
        return self.global_loss_sum / n if n else float("nan")

    def to_json(self) -> dict[str, object]:
        """The totals as JSON (the keys are the fields' names)."""
        return {"step": self.step, "t0": self.t0, "t": self.t, "grad_norm": self.grad_norm,
                "overflow": self.overflow, "finite": self.finite,
                "data_wait_s": self.data_wait_s, "global_loss_sum": self.global_loss_sum,
                "global_samples": self.global_samples,
                "global_metric_sums": dict(self.global_metric_sums), "lr": self.lr,
                "ranks": None if self.ranks is None else self.ranks.to_json()}


def stream_chunk(records: Sequence[StepTotals]) -> str:
    """A chunk of the steps rank 0 streams while its run goes on: their totals, as JSON."""
    return json.dumps([r.to_json() for r in records])


def read_stream_chunk(raw: str | bytes) -> list[StepTotals]:
    """The totals of a chunk :func:`stream_chunk` wrote."""
    out = []
    for rec in json.loads(raw):
        ranks = rec.pop("ranks", None)
        out.append(StepTotals(**rec, ranks=None if ranks is None else RankTimes.from_json(ranks)))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRecord(StepTotals):
    """One rank's record of a step it ran: the step's totals, known to every rank, and this
    rank's own part: what it was served, its own metric sums, and its timings (the time
    it waited for its samples is ``data_wait_s``)."""

    served: Served
    metric_sums: Mapping[str, float]
    compute_s: float
    reduce_s: float

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
    ledger); ``preempting``: this worker got a preemption notice."""

    steps: Sequence[StepRecord]
    ended: RunEnd
    steps_done: int
    preempting: bool

    def merge(self, theirs: Sequence[RunReport]) -> RunReport:
        return replace(self, steps=merge_records(self.steps, [t.steps for t in theirs]),
                       preempting=self.preempting or any(t.preempting for t in theirs))


@dataclass(frozen=True, kw_only=True, slots=True)
class HeldWork:
    """The micro-batches of step ``step`` (global numbers) whose gradient sum a worker kept
    when the step failed before it was applied (see :mod:`planaria.worker.kept_work`);
    ``unstarted``, those of its attempt it had not begun (stopped between two): computed
    later, but never lost, so the lost work is told apart from the work still to do."""

    step: int
    micro_batches: tuple[int, ...]
    unstarted: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class CarriedStep:
    """A worker's part of step ``step`` resumed after a fault (the first step of the run it
    comes with): ``kept``, the micro-batches whose gradient sum it holds
    (:class:`HeldWork`); ``new``, those it computes now (global numbers, ascending)."""

    step: int
    kept: tuple[int, ...]
    new: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Settled:
    """A worker after a failed run (``Worker.settle_run``): how far it got, the records
    of the steps it applied in that run, and the finished micro-batches of the step that
    failed whose gradient it kept (``held``; None: none kept)."""

    steps_done: int
    steps: Sequence[StepRecord]
    held: HeldWork | None = None

    def merge(self, theirs: Sequence[Settled]) -> Settled:
        return replace(self, steps=merge_records(self.steps, [t.steps for t in theirs]))


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFailed:
    """A run a peer's failure ended on this worker (``Worker.run``): its collective broke,
    or the controller told it to abort. Answered, not raised: a Ray task error (a
    traceback formatted, pickled and published) put 2 to 20 ms between a survivor's end
    and the controller's knowing it (medium model, 3 replicas, 2 cores). ``error``: what
    it saw; ``settled``: its answer to ``Worker.settle_run``, which the controller then
    need not ask for."""

    error: str
    settled: Settled


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
    ``ckpt_advance``): its steps done."""

    steps_done: int

    def merge(self, theirs: Sequence[Hold]) -> Hold:
        """A replica is as far as its least advanced worker."""
        return Hold(steps_done=min([self.steps_done, *(t.steps_done for t in theirs)]))
