"""The seeded fault schedule: which faults, in which run, at which step and point, how slow.

A campaign of N faults is a list of runs; each run is one training job with a
few faults spaced ``gap`` steps apart, each at a planned step and a planned
point inside it (which micro-batch of the target's share, and how far into
it). Kinds are dealt in shuffled rounds of the whole mix, so every kind
appears once N reaches the mix's size; step lengths are dealt the same way over
runs. The schedule depends on nothing but the :class:`MixConfig`.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from planaria.config import check

__all__ = [
    "CHECKPOINT_KINDS",
    "COMPOUND_KINDS",
    "DEFAULT_STEP_S",
    "KINDS",
    "MixConfig",
    "PlannedFault",
    "PlannedRun",
    "plan_campaign",
]

KINDS = (
    "kill",  # SIGKILL inside a step
    "hang",  # SIGSTOP inside a step: the watchdog must find it
    "preempt",  # SIGTERM inside a step: drained at the next boundary
    "slow",  # SIGSTOP/SIGCONT duty cycle: a straggler that must stay
    "kill_rerun",  # a kill, then another while the failed step runs again
    "kill_join",  # a kill, then another while its replacement receives the state
    "kill_save",  # SIGKILL to a writer while a checkpoint is being written
    "kill_restore",  # a non-finite loss rolls back; SIGKILL while the restore reads
    "storage_write",  # the next checkpoint write raises OSError
    "storage_read",  # a non-finite loss rolls back; the restore's next read raises OSError
    "nonfinite",  # a NaN loss at one (step, attempt): rollback and re-run
    "job_kill",  # SIGKILL to the whole job inside a step, then a resume
)
COMPOUND_KINDS = frozenset({"kill_rerun", "kill_join", "kill_restore"})
CHECKPOINT_KINDS = frozenset({"kill_restore", "storage_read", "nonfinite", "job_kill"})
DEFAULT_STEP_S = (0.05, 0.5, 2.0, 10.0)


@dataclass(frozen=True, kw_only=True)
class PlannedFault:
    """One fault of a run. ``target`` picks a live worker (modulo the width) when it is armed."""

    index: int
    kind: str
    step: int
    target: int
    micro_batch: int
    """Which micro-batch of the target's share of the step (clipped to the share when armed)."""
    fraction: float
    """How far into that micro-batch's (stretched) compute the signal lands, 0..1."""
    variant: str = ""
    """kill_join: kill the ``joiner`` or the ``source`` of the state transfer; storage_*:
    fail a ``shard`` file or ``any`` file (manifest, marker) of a checkpoint."""
    ahead: int = 0
    """Steps between the boundary where it is armed and its ``step``: the job's autonomous
    run goes on meanwhile, so the fault lands in the run's first step (0) or a later one."""


@dataclass(frozen=True, kw_only=True)
class PlannedRun:
    """One training job of the campaign."""

    index: int
    step_s: float
    steps: int
    faults: tuple[PlannedFault, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlannedRun:
        faults = tuple(PlannedFault(**f) for f in data["faults"])
        return cls(index=data["index"], step_s=data["step_s"], steps=data["steps"], faults=faults)


@dataclass(frozen=True, kw_only=True)
class MixConfig:
    """What a campaign draws from."""

    faults: int
    seed: int = 0
    kinds: tuple[str, ...] = KINDS
    step_lengths: tuple[float, ...] = DEFAULT_STEP_S
    faults_per_run: tuple[int, int] = (3, 5)
    """Inclusive range of faults per run."""
    gap: int = 3
    """Steps between two faults of a run (each recovers before the next is armed)."""
    checkpoint_every: int = 3
    """Checkpoint interval in steps; the first fault comes after two checkpoints."""
    tail: int = 3
    """Steps after the last fault, at full width again."""
    micro_batches: int = 2
    """Micro-batches in a rank's share at full width (for the point inside a step)."""

    def __post_init__(self) -> None:
        check(isinstance(self.faults, int) and self.faults >= 0, "faults", self.faults,
              "an integer >= 0")
        unknown = [k for k in self.kinds if k not in KINDS]
        check(bool(self.kinds) and not unknown, "kinds", self.kinds,
              f"a non-empty list of {', '.join(KINDS)}")
        check(bool(self.step_lengths) and all(s > 0 for s in self.step_lengths),
              "step_lengths", self.step_lengths, "a non-empty list of seconds > 0")
        lo, hi = self.faults_per_run
        check(1 <= lo <= hi, "faults_per_run", self.faults_per_run, "(lo, hi) with 1 <= lo <= hi")
        check(self.gap >= 2, "gap", self.gap, "an integer >= 2 (a fault's step, then its re-run)")
        check(self.checkpoint_every >= 1, "checkpoint_every", self.checkpoint_every,
              "an integer >= 1")
        check(self.tail >= 1, "tail", self.tail, "an integer >= 1")
        check(self.micro_batches >= 1, "micro_batches", self.micro_batches, "an integer >= 1")

    @property
    def lead(self) -> int:
        """The first fault's step: the step after the second checkpoint's boundary. With
        ``gap == checkpoint_every`` (the defaults) every fault's step follows a checkpoint
        boundary, so the run of steps it lands in (``ahead`` steps in, or in its first
        step) is not cut to one step by the next checkpoint."""
        return 2 * self.checkpoint_every + 1


def _dealt(rng: random.Random, items: tuple[Any, ...], count: int) -> list[Any]:
    """``count`` items in shuffled rounds of all of them (balanced, every item early)."""
    out: list[Any] = []
    while len(out) < count:
        round_ = list(items)
        rng.shuffle(round_)
        out += round_
    return out[:count]


def _variant(rng: random.Random, kind: str) -> str:
    if kind == "kill_join":
        return rng.choice(("joiner", "source"))
    if kind.startswith("storage_"):
        return rng.choice(("shard", "any"))
    return ""


def plan_campaign(config: MixConfig) -> list[PlannedRun]:
    """The campaign's runs, deterministic in ``config``."""
    rng = random.Random(config.seed)
    kinds = _dealt(rng, config.kinds, config.faults)
    runs: list[PlannedRun] = []
    lo, hi = config.faults_per_run
    lengths: list[float] = []
    while kinds:
        take = min(len(kinds), rng.randint(lo, hi))
        chosen, kinds = kinds[:take], kinds[take:]
        if chosen.count("job_kill") > 1:  # one whole-job kill per run: the rest go back
            first = chosen.index("job_kill")
            kinds = [k for i, k in enumerate(chosen) if k == "job_kill" and i > first] + kinds
            chosen = [k for i, k in enumerate(chosen) if k != "job_kill" or i == first]
        # The whole-job kill ends its run's fault list: the resumed job runs to the end.
        chosen.sort(key=lambda k: k == "job_kill")
        if not lengths:
            lengths = _dealt(rng, config.step_lengths, len(config.step_lengths))
        step_s = lengths.pop()
        faults = tuple(
            PlannedFault(
                index=i,
                kind=kind,
                step=config.lead + i * config.gap,
                target=rng.randrange(1000),
                micro_batch=rng.randrange(config.micro_batches),
                fraction=round(rng.uniform(0.05, 0.95), 3),
                variant=_variant(rng, kind),
                ahead=rng.randrange(config.gap),
            )
            for i, kind in enumerate(chosen)
        )
        steps = config.lead + (len(faults) - 1) * config.gap + config.tail + 1
        runs.append(PlannedRun(index=len(runs), step_s=step_s, steps=steps, faults=faults))
    return runs
