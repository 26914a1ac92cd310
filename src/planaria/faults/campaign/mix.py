"""The seeded fault schedule: which faults, in which run, at which step and point, how slow,
and each run's configuration.

A campaign of N faults is a list of runs; each run is one training job with a
few faults spaced ``gap`` steps apart, each at a planned step and a planned
point inside it (which micro-batch of the target's share, and how far into
it). Kinds are dealt in shuffled rounds of the whole mix, so every kind
appears once N reaches the mix's size; step lengths are dealt the same way over
runs. Each run's configuration (:class:`RunShape`) is drawn too: the spec, the
width, sharded replicas, spares, overlapped reduction, the checkpoint interval,
or the user's defaults (no ledger, the ``auto`` interval). The schedule depends
on nothing but the :class:`MixConfig`.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from planaria.config import check
from planaria.faults.campaign.specs import CAMPAIGN_SPECS

__all__ = [
    "CHECKPOINT_KINDS",
    "COMPOUND_KINDS",
    "DEFAULT_STEP_S",
    "KINDS",
    "SAVING_KINDS",
    "TOLERATED_KINDS",
    "WHOLE_JOB_KINDS",
    "MixConfig",
    "PlannedFault",
    "PlannedRun",
    "RunShape",
    "plan_campaign",
]

KINDS = (
    "kill",  # SIGKILL inside a step
    "hang",  # SIGSTOP inside a step: the watchdog must find it
    "preempt",  # SIGTERM inside a step: drained at the next boundary
    "slow",  # SIGSTOP/SIGCONT duty cycle: a straggler that must stay
    "kill_rerun",  # a kill, then another while the failed step runs again
    "kill_join",  # a kill, then another while its replacement receives the state
    "kill_save",  # SIGKILL to a writer inside a checkpoint's snapshot or its write
    "kill_restore",  # a non-finite loss rolls back; SIGKILL inside the restore's reads
    "storage_write",  # the next checkpoint write raises OSError
    "storage_read",  # a non-finite loss rolls back; the restore's next read raises OSError
    "nonfinite",  # a NaN loss at one (step, attempt): rollback and re-run
    "job_kill",  # SIGKILL to the whole job inside a step, then a resume
    "bad_sample",  # one sample's __getitem__ raises OSError, every time
    "slow_sample",  # one load sleeps several step lengths
    "heavy_microbatch",  # one micro-batch burns CPU for several step lengths
    "fleet_preempt",  # SIGTERM to every member at once, SIGKILL after a grace
    "controller_kill",  # SIGKILL to the controller alone (in a step or a commit), then a resume
    "stall",  # a worker's main thread blocked in its loss, its heartbeat alive
    "pause",  # one SIGSTOP/SIGCONT pause between 2 s and the heartbeat deadline
    "disk_full",  # ENOSPC part-way through writes: the checkpoint root, or the run dir
    "gcs_kill",  # SIGKILL to the job's own Ray GCS, then a resume
    "raylet_kill",  # SIGKILL to the job's own raylet, then a resume
    "preempt_during_save",  # SIGTERM to a writer while its shard is written
    "kill_starting",  # a kill, then a kill of its replacement before it is ready
    "kill_spare",  # a kill (a spare takes its place), then a kill of the new spare warming up
    "kill_final_save",  # SIGKILL to a writer of the final save
    "kill_resumed",  # a whole-job kill, then a kill in the job started again
    "link_stall",  # a worker's process-group flows dropped (netfilter), its heartbeat alive
)
COMPOUND_KINDS = frozenset({"kill_rerun", "kill_join", "kill_restore", "kill_starting",
                            "kill_spare", "kill_resumed"})
WHOLE_JOB_KINDS = frozenset({"job_kill", "controller_kill", "gcs_kill", "raylet_kill",
                             "kill_resumed"})
"""The job process ends (killed, or with an error); the campaign starts it again."""
TOLERATED_KINDS = frozenset({"slow", "storage_write", "bad_sample", "slow_sample",
                             "heavy_microbatch", "pause", "disk_full"})
"""Faults that need no recovery (nothing may be evicted or lost): counted apart."""
CHECKPOINT_KINDS = frozenset({"kill_restore", "storage_read", "nonfinite", "job_kill",
                              "controller_kill", "gcs_kill", "raylet_kill", "kill_resumed"})
"""Faults whose recovery restores a checkpoint: lost steps are bounded by the newest save
whose writers had finished (every other recovery loses none)."""
FINAL_KINDS = frozenset({"kill_final_save"})
"""Faults at the run's end, not at a step of its own."""
SAVING_KINDS = frozenset({"kill_save", "preempt_during_save", "storage_write", "kill_restore",
                          "storage_read", "nonfinite", "disk_full", "controller_kill"})
"""Faults that need interval saves (a save to hit, a checkpoint to roll back to, a commit to
kill the controller in): their runs draw a checkpoint interval in steps, never ``auto`` (its
first save comes minutes in) nor the user's defaults."""
DEFAULT_STEP_S = (0.05, 0.5, 2.0, 10.0)
INTERVALS: tuple[int | str, ...] = (2, 3, 4, "auto")

_VARIANTS = {
    "kill_join": ("joiner", "source"),
    "storage_write": ("shard", "any"),
    "storage_read": ("shard", "any"),
    "kill_save": ("snapshot", "write"),
    "kill_final_save": ("snapshot", "write"),
    "controller_kill": ("step", "commit"),
    "disk_full": ("checkpoints", "run_dir"),
    "kill_resumed": ("job", "controller"),
}


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
    """How far into that micro-batch's (stretched) compute the signal lands, 0..1; for faults
    that target a window (a save's write, a transfer, a restore's reads), how far into it."""
    variant: str = ""
    """kill_join: kill the ``joiner`` or the ``source`` of the state transfer; storage_*:
    fail a ``shard`` file or ``any`` file (manifest, marker) of a checkpoint; kill_save and
    kill_final_save: inside the ``snapshot`` or the ``write``; controller_kill: inside a
    ``step`` or a ``commit``; disk_full: the ``checkpoints`` root or the ``run_dir``;
    kill_resumed: the first half is a ``job`` kill or a ``controller`` kill."""
    ahead: int = 0
    """Steps between the boundary where it is armed and its ``step``: the job's autonomous
    run goes on meanwhile, so the fault lands in the run's first step (0) or a later one."""
    draw: float = 0.5
    """A uniform draw in [0, 1) for the kind's own magnitude: a grace period, a pause, how
    many step lengths a slow load or a heavy micro-batch takes, how long a disk stays full."""


@dataclass(frozen=True, kw_only=True)
class RunShape:
    """One run's configuration, drawn from the seed."""

    spec: str = "mlp"
    """A campaign spec (:data:`planaria.faults.campaign.specs.CAMPAIGN_SPECS`) or
    SCRIPT.py[:SPEC]."""
    replicas: int = 3
    workers_per_replica: int = 1
    spares: int = 0
    overlap: bool = False
    checkpoint_every: int | str = 3
    ledger: bool = True
    """False with ``checkpoint_every="auto"``: the user's defaults; judged exactly-once from
    the campaign dataset's own load record."""

    @property
    def defaults(self) -> bool:
        return not self.ledger and self.checkpoint_every == "auto"

    def describe(self) -> str:
        parts = [self.spec, f"{self.replicas}x{self.workers_per_replica}"]
        if self.spares:
            parts.append(f"spares={self.spares}")
        if self.overlap:
            parts.append("overlap")
        parts.append("defaults" if self.defaults else f"every={self.checkpoint_every}")
        return " ".join(parts)


@dataclass(frozen=True, kw_only=True)
class PlannedRun:
    """One training job of the campaign."""

    index: int
    step_s: float
    steps: int
    faults: tuple[PlannedFault, ...]
    shape: RunShape = field(default_factory=RunShape)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlannedRun:
        faults = tuple(PlannedFault(**f) for f in data["faults"])
        shape = RunShape(**data["shape"]) if "shape" in data else RunShape()
        return cls(index=data["index"], step_s=data["step_s"], steps=data["steps"],
                   faults=faults, shape=shape)


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
    intervals: tuple[int | str, ...] = INTERVALS
    """Checkpoint intervals drawn per run (steps, or "auto"); the first fault comes after two
    checkpoints of a numeric interval."""
    tail: int = 3
    """Steps after the last fault, at full width again."""
    min_steps: int = 12
    """Every run trains at least this many steps (the campaign's specs have 10 a epoch:
    every run crosses an epoch boundary)."""
    micro_batches: int = 2
    """Micro-batches in a rank's share at full width (for the point inside a step)."""
    specs: tuple[str, ...] = CAMPAIGN_SPECS
    """The specs drawn per run."""
    shardable: tuple[str, ...] = ("mlp", "tiny_gpt")
    """The specs that may run as sharded replicas (no persistent buffers: no BatchNorm)."""
    replicas: tuple[int, int] = (2, 4)
    """Inclusive range of replicas drawn per run."""
    sharded_share: float = 0.3
    """The share of runs (of shardable specs) with ``workers_per_replica=2``."""
    spares_share: float = 0.3
    """The share of runs with a hot spare."""
    overlap_share: float = 0.3
    """The share of unsharded runs with overlapped reduction."""
    defaults_share: float = 0.25
    """The share of runs on the user's defaults: no ledger, the ``auto`` interval."""
    step_micro_batches: int = 8
    """Micro-batches in the specs' global batch: a run's workers (replicas x workers per
    replica) never outnumber them (every worker runs whole micro-batches)."""

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
        check(bool(self.intervals) and all(
            (isinstance(i, int) and i >= 1) or i == "auto" for i in self.intervals),
            "intervals", self.intervals, 'a non-empty list of integers >= 1 or "auto"')
        check(self.tail >= 1, "tail", self.tail, "an integer >= 1")
        check(self.micro_batches >= 1, "micro_batches", self.micro_batches, "an integer >= 1")
        check(self.step_micro_batches >= self.replicas[0], "step_micro_batches",
              self.step_micro_batches, f"at least replicas' low end, {self.replicas[0]}")
        check(bool(self.specs), "specs", self.specs, "a non-empty list of specs")
        rlo, rhi = self.replicas
        check(2 <= rlo <= rhi, "replicas", self.replicas,
              "(lo, hi) with 2 <= lo <= hi (survivors must hold the state)")
        for name in ("sharded_share", "spares_share", "overlap_share", "defaults_share"):
            value = getattr(self, name)
            check(0.0 <= value <= 1.0, name, value, "a share between 0 and 1")

    def lead(self, interval: int | str) -> int:
        """The first fault's step: the step after the second checkpoint's boundary (a
        rollback has something to restore; with ``gap`` equal to the interval every fault's
        step follows a checkpoint boundary, so its run of steps is not cut to one step)."""
        every = interval if isinstance(interval, int) else 3
        return 2 * every + 1


def _dealt(rng: random.Random, items: tuple[Any, ...], count: int) -> list[Any]:
    """``count`` items in shuffled rounds of all of them (balanced, every item early)."""
    out: list[Any] = []
    while len(out) < count:
        round_ = list(items)
        rng.shuffle(round_)
        out += round_
    return out[:count]


def _variant(rng: random.Random, kind: str) -> str:
    choices = _VARIANTS.get(kind)
    return rng.choice(choices) if choices else ""


def _fits(chosen: list[str], kind: str) -> bool:
    """Whether ``kind`` can join a run that has ``chosen``: one whole-job fault, one final
    fault and one disk fault a run, and no run that needs a spare and none at once."""
    if kind in WHOLE_JOB_KINDS and any(k in WHOLE_JOB_KINDS for k in chosen):
        return False
    if kind in FINAL_KINDS | {"disk_full"} and kind in chosen:
        return False
    spare, none = {"kill_spare"}, {"kill_starting"}
    return not ((kind in spare and none & set(chosen)) or (kind in none and spare & set(chosen)))


def _shape(rng: random.Random, config: MixConfig, kinds: list[str]) -> RunShape:
    spec = rng.choice(config.specs)
    lo, hi = config.replicas
    replicas = rng.randint(lo, min(hi, config.step_micro_batches))
    sharded = (spec in config.shardable and rng.random() < config.sharded_share
               and 2 * replicas <= config.step_micro_batches)
    spares = 1 if rng.random() < config.spares_share else 0
    if "kill_spare" in kinds:
        spares = 1
    elif "kill_starting" in kinds:
        spares = 0
    if "link_stall" in kinds:  # a culprit to name: three ranks or more, one worker each
        replicas, sharded = max(3, replicas), False
    overlap = not sharded and rng.random() < config.overlap_share
    defaults = rng.random() < config.defaults_share
    every = "auto" if defaults else rng.choice(config.intervals)
    if SAVING_KINDS & set(kinds):
        steps = [i for i in config.intervals if isinstance(i, int)] or [3]
        defaults, every = False, every if isinstance(every, int) else rng.choice(steps)
    return RunShape(spec=spec, replicas=replicas, workers_per_replica=2 if sharded else 1,
                    spares=spares, overlap=overlap, checkpoint_every=every,
                    ledger=not defaults)


def plan_campaign(config: MixConfig) -> list[PlannedRun]:
    """The campaign's runs, deterministic in ``config``."""
    rng = random.Random(config.seed)
    kinds = _dealt(rng, config.kinds, config.faults)
    runs: list[PlannedRun] = []
    lo, hi = config.faults_per_run
    lengths: list[float] = []
    while kinds:
        take = min(len(kinds), rng.randint(lo, hi))
        chosen: list[str] = []
        back: list[str] = []
        for kind in kinds[:take]:  # what does not fit goes back, to the next run
            (chosen if _fits(chosen, kind) else back).append(kind)
        kinds = back + kinds[take:]
        # The whole-job fault ends its run's step faults (the resumed job runs to the end);
        # a fault of the final save comes last of all.
        chosen.sort(key=lambda k: (k in FINAL_KINDS, k in WHOLE_JOB_KINDS))
        if not lengths:
            lengths = _dealt(rng, config.step_lengths, len(config.step_lengths))
        step_s = lengths.pop()
        shape = _shape(rng, config, chosen)
        lead = config.lead(shape.checkpoint_every)
        stepped = [k for k in chosen if k not in FINAL_KINDS]
        steps = lead + (max(1, len(stepped)) - 1) * config.gap + config.tail + 1
        steps = max(steps, config.min_steps)
        faults = tuple(
            PlannedFault(
                index=i,
                kind=kind,
                step=lead + i * config.gap if kind not in FINAL_KINDS else steps,
                target=rng.randrange(1000),
                micro_batch=rng.randrange(config.micro_batches),
                fraction=round(rng.uniform(0.05, 0.95), 3),
                variant=_variant(rng, kind),
                # A sample fault is armed two steps ahead of its sample's step (loaded ahead).
                ahead=2 if kind in ("bad_sample", "slow_sample") else rng.randrange(config.gap),
                draw=round(rng.random(), 3),
            )
            for i, kind in enumerate(chosen)
        )
        runs.append(PlannedRun(index=len(runs), step_s=step_s, steps=steps, faults=faults,
                               shape=shape))
    return runs
