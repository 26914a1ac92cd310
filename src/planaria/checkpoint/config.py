"""What a job's checkpoints are: where, how often, what is kept, how a restore behaves
(:class:`CheckpointConfig`, given to ``fit`` or ``Job``; the controller's
:class:`planaria.checkpoint.coordinator.Checkpointer` carries it out)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from planaria.checkpoint.interval import CheckpointInterval
from planaria.config import check
from planaria.field_docs import document_fields

__all__ = ["CheckpointConfig"]


@document_fields
@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often a job saves checkpoints, and whether it resumes from them."""

    root: str | None = None
    """A path (made absolute) or fsspec URL (s3://, gs://; every worker must reach it, so
    not memory://); None: RUN_DIR/checkpoints."""
    every: int | str | None = None
    """N steps (int or "500"), a duration ("90s", "10m"), "auto" (Young/Daly); None: no saves."""
    keep_last: int | None = 3
    """Keep the newest this many committed checkpoints (None: keep all)."""
    keep_every: int | None = None
    """Also keep for good every checkpoint whose step is a multiple of this."""
    resume: bool = True
    """At start, restore the newest viable checkpoint of the root's lineage if there is one
    (an error, not a start from step 0, if checkpoints exist and none is viable)."""
    on_other_run: Literal["refuse", "overwrite", "branch"] = "refuse"
    """``resume=False`` on a root holding another run's checkpoints: refuse (an error),
    overwrite (delete them first) or branch (keep them; this run starts its own lineage
    beside them and never restores, ranks or deletes theirs, except a step it re-saves)."""
    strict: bool = True
    """A restore needs the checkpoint's tensors to match the job's (names, shapes, dtypes);
    False: report the differences (``checkpoint_mismatch``) and load the tensors that match."""
    replan_data: bool = False
    """Resume even if the data plan (dataset length, global batch, seed) differs from the
    checkpoint's: the samples are then planned anew from the resumed step."""
    storage_attempts: int = 3
    """Tries of a storage operation (with backoff) before it counts as failed."""
    lease_ttl_s: float = 30.0
    """The lease on the root lasts this long past each renewal; a background thread renews
    it every third of that. A controller started again takes over at once the lease of a
    holder on this machine that no longer runs, and waits at most this long for one it
    cannot check (another host): renewed meanwhile, the holder is live and the start is
    refused (see planaria.checkpoint.lease)."""
    staging_budget_bytes: int | None = None
    """Host memory a worker may hold for staging its share (None: no bound; the staging
    buffers then hold the share, about 1/N of the state, from one save to the next). A
    share over the budget is written from the live tensors while training waits (all of
    it stall)."""
    min_bytes_per_s: float = 20e6
    """Deadlines of saves and restores grow by one second per this many bytes."""
    if_busy: Literal["wait", "skip"] = "wait"
    """A save falls due while the previous one is still writing: wait for it, or skip this one."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to fsspec (e.g. endpoint_url, key, secret for S3)."""
    mtbf_prior_s: float = 24 * 3600.0
    """every="auto": the job's mean time between failures assumed before any is seen."""
    stall_prior_s: float = 1.0
    """every="auto": the save stall assumed before one is measured."""
    auto_max_steps: int | None = None
    """every="auto": never more steps than this between saves (None: no bound)."""
    restore_strategy: Literal["auto", "read_all", "share"] = "auto"
    """Each replica reads all, or a share plus broadcast; auto: read_all when every replica
    is on one node, share when they span several (see the module doc)."""
    continuous: bool = False
    """every="auto": when the optimum is shorter than a save takes, save back to back
    instead of once per save time."""
    save_on_preemption: bool = True
    """Save just in time when a preemption would leave fewer than min_replicas (needs ``every``)."""
    fsync: bool = True
    """fsync shard files and directories on local disk (off only for benchmarks and tests)."""
    direct_io: bool = True
    """On local disk, write each staged shard and read it back with ``O_DIRECT`` (the disk's
    DMA moves the bytes; no page-cache copy competes with training for CPU). File systems
    without it fall back to buffered writes by themselves; False forces buffered writes."""
    copy_beside: bool = True
    """A save's copy into staging runs beside the next step's forward and backward (host
    tensors; a save from the GPU copies before training goes on): training waits for
    it only if the next update comes before the copy ends (``checkpoint_saved``'s
    ``blocked_s``). False: training waits for the whole copy at the save."""
    max_failed_saves: int = 3
    """This many saves in a row that do not commit (a full disk, a lost bucket) are escalated:
    a ``checkpoints_failing`` event and a warning naming the newest committed step, then
    ``on_failing``."""
    on_failing: Literal["warn", "stop"] = "warn"
    """After ``max_failed_saves`` failed saves in a row: go on training (warn; every further
    failure is warned about again), or stop the job with a CheckpointError (its trained
    state is not durable: the newest committed checkpoint is older and older)."""
    timeout_s: float = 600.0
    """Base deadline for a blocking save (final, just in time) or a restore's reads (plus
    one second per ``min_bytes_per_s`` bytes)."""

    def __post_init__(self) -> None:
        check(self.root is None or (isinstance(self.root, str) and bool(self.root)), "root",
              self.root, "a path or fsspec URL, or None for RUN_DIR/checkpoints")
        check(not (isinstance(self.root, str) and self.root.startswith("memory://")), "root",
              self.root, "a path or a URL every worker reaches (memory:// lives in one "
              "process: the workers would each see their own)")
        check(self.on_other_run in ("refuse", "overwrite", "branch"), "on_other_run",
              self.on_other_run, "'refuse', 'overwrite' or 'branch'")
        check(isinstance(self.strict, bool), "strict", self.strict, "True or False")
        check(isinstance(self.replan_data, bool), "replan_data", self.replan_data,
              "True or False")
        check(isinstance(self.storage_attempts, int) and self.storage_attempts >= 1,
              "storage_attempts", self.storage_attempts, "an integer >= 1")
        check(self.lease_ttl_s > 0, "lease_ttl_s", self.lease_ttl_s, "seconds > 0")
        check(self.staging_budget_bytes is None or (isinstance(self.staging_budget_bytes, int)
              and self.staging_budget_bytes >= 0), "staging_budget_bytes",
              self.staging_budget_bytes, "bytes >= 0, or None for no bound")
        check(self.min_bytes_per_s > 0, "min_bytes_per_s", self.min_bytes_per_s,
              "bytes per second > 0")
        if self.every is not None:
            try:
                CheckpointInterval.from_spec(self.every)
            except (ValueError, TypeError) as err:
                check(False, "every", self.every, f"N steps, '90s'/'10m'/'2h', or 'auto' ({err})")
        check(self.keep_last is None or (isinstance(self.keep_last, int) and self.keep_last >= 1),
              "keep_last", self.keep_last, "an integer >= 1 or None")
        every_ok = isinstance(self.keep_every, int) and self.keep_every >= 1
        check(self.keep_every is None or every_ok, "keep_every", self.keep_every,
              "an integer >= 1 or None")
        check(isinstance(self.resume, bool), "resume", self.resume, "True or False")
        check(self.if_busy in ("wait", "skip"), "if_busy", self.if_busy, "'wait' or 'skip'")
        check(isinstance(self.storage_options, dict), "storage_options", self.storage_options,
              "a dict")
        check(self.mtbf_prior_s > 0, "mtbf_prior_s", self.mtbf_prior_s, "seconds > 0")
        check(self.stall_prior_s >= 0, "stall_prior_s", self.stall_prior_s, "seconds >= 0")
        check(self.auto_max_steps is None or self.auto_max_steps >= 1, "auto_max_steps",
              self.auto_max_steps, "an integer >= 1 or None")
        check(self.restore_strategy in ("auto", "read_all", "share"), "restore_strategy",
              self.restore_strategy, "'auto', 'read_all' or 'share'")
        check(self.timeout_s > 0, "timeout_s", self.timeout_s, "seconds > 0")
        check(isinstance(self.max_failed_saves, int) and self.max_failed_saves >= 1,
              "max_failed_saves", self.max_failed_saves, "an integer >= 1")
        check(self.on_failing in ("warn", "stop"), "on_failing", self.on_failing,
              "'warn' or 'stop'")

    @classmethod
    def from_cli(
        cls, every: str | None = None, resume: bool = True, root: str | None = None, **options: Any
    ) -> CheckpointConfig:
        """From ``--checkpoint-every`` (None: no saves), ``--no-resume`` (``resume=False``) and a
        root (None: RUN_DIR/checkpoints); ``options`` are further fields."""
        return cls(every=every, resume=resume, root=root, **options)
