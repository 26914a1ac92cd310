"""What a run dir says of the controller that wrote it: its run, its newest generation and
lease epoch, the steps it committed, the samples it skipped.

The event log (``events.jsonl``, always written) is replayed from the newest ``run_start``
on: ``generation`` names each generation's members (and the lease epoch it was built
under), ``step_committed`` and ``steps_committed_by_save`` commit steps, ``step_skipped``
drops a step's update (it counts as done), ``restore`` sets the step count (a
checkpoint's, or the seed's at 0), ``sample_skipped`` leaves samples out. The ledger
(``ledger.jsonl``, opt-in) names the run that last wrote it (the newest run's, or an
earlier one's until the newest commits a step) and the steps it committed.
:mod:`planaria.control.takeover` rebuilds the controller's state from this and from the
live workers' reports.

:func:`finished_job` reads the run dir and its checkpoint root for a job run again with
nothing left to train (``planaria run`` says so and starts nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planaria.checkpoint.config import CheckpointConfig
from planaria.checkpoint.newest import lineage_checkpoints
from planaria.checkpoint.root import CheckpointRoot
from planaria.data.ledger import Ledger
from planaria.faults.errors import CheckpointError, StorageError
from planaria.observe.events import EVENTS_FILE, read_events

__all__ = ["FinishedJob", "RunRecord", "finished_job", "read_run_record"]


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """A run dir's record of its newest run (see the module doc)."""

    run_id: str | None
    """The newest ``run_start``'s run (None: no event log, or no run started in it)."""
    earlier_runs: tuple[str, ...] = ()
    """The runs started in the run dir before it (a job resumed there), oldest first."""
    gen: int = -1
    """The newest generation built (-1: none)."""
    members: tuple[str, ...] = ()
    """That generation's workers, in rank order."""
    epoch: int = 0
    """The newest lease epoch a generation was built under (0: none recorded)."""
    steps_done: int = 0
    """Steps committed (a skipped step counts: it is consumed)."""
    last_skipped: int = -1
    """The newest step whose update was dropped (a non-finite loss), -1: none."""
    skipped_samples: frozenset[int] = frozenset()
    """Samples left out from some step on (a fault of the work, skipped)."""
    ledger_run: str | None = None
    """The run of the ledger's newest record (None: no ledger, or an empty one)."""
    ledger_steps: int | None = None
    """Steps the ledger holds committed for ``run_id``: its newest commit record's step + 1
    (None: no ledger)."""


def _events_and_starts(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[int]]:
    """``run_dir``'s event records and the indices of its ``run_start`` records (both empty
    where it has no event log)."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return [], []
    events = list(read_events(path))
    return events, [i for i, e in enumerate(events) if e["event"] == "run_start"]


def read_run_record(run_dir: str | Path) -> RunRecord:
    """The record of ``run_dir``'s newest run (an empty one where it has no event log)."""
    run_dir = Path(run_dir)
    events, starts = _events_and_starts(run_dir)
    if not starts:
        return RunRecord(run_id=None)
    run_id = str(events[starts[-1]]["run_id"])
    fields: dict[str, Any] = {"run_id": run_id, "earlier_runs": tuple(
        str(events[i]["run_id"]) for i in starts[:-1])}
    steps, last_skipped, epoch = 0, -1, 0
    skipped: set[int] = set()
    for e in events[starts[-1]:]:
        kind = e["event"]
        if kind == "generation":
            fields.update(gen=int(e["gen"]), members=tuple(e["workers"]))
            epoch = max(epoch, int(e.get("epoch", 1)))
        elif kind == "step_committed":
            steps = int(e["step"]) + 1
        elif kind == "steps_committed_by_save":
            steps = max(steps, int(e["step"]))
        elif kind == "step_skipped":
            steps, last_skipped = int(e["step"]) + 1, int(e["step"])
        elif kind == "restore":
            steps = int(e["step"])
        elif kind == "sample_skipped":
            skipped.update(int(i) for i in e["samples"])
    fields.update(epoch=epoch, steps_done=steps, last_skipped=last_skipped,
                  skipped_samples=frozenset(skipped))
    if (run_dir / Ledger.FILE).exists():
        records = Ledger.read(run_dir)
        commits = [int(r["step"]) for r in records
                   if r["kind"] == "commit" and r.get("run") == run_id]
        fields.update(ledger_run=records[-1].get("run") if records else None,
                      ledger_steps=commits[-1] + 1 if commits else 0)
    return RunRecord(**fields)


@dataclass(frozen=True, kw_only=True)
class FinishedJob:
    """A job that has trained its steps already (see :func:`finished_job`)."""

    step: int
    """The step of its newest committed checkpoint: the steps it trained."""
    run_id: str
    """The run (``run_start.run_id``) whose end says it finished."""
    checkpoint: str
    """That checkpoint's path."""


def finished_job(run_dir: str | Path, steps: int,
                 checkpoint: CheckpointConfig | None) -> FinishedJob | None:
    """The job in ``run_dir`` if running it again to ``steps`` would train nothing, else
    None; reads the event log and the checkpoint root's listing and commit markers, starts
    nothing. Finished means all of:

    - the run resumes (``checkpoint`` given with ``resume``): a run that does not is a new
      job;
    - the event log's newest controller ended cleanly: its segment's ``run_end`` has
      status ``ok`` and a ``step`` of at least ``steps`` (a run that failed, was
      interrupted or crashed is not finished, and resumes as before);
    - the newest committed checkpoint of the lineage that run continued (its
      ``checkpoint_lineage`` record) under the root ``checkpoint`` names has a step of at
      least ``steps``: what a resume would restore has trained them (the final save
      committed). Whether it verifies is left to the resume of a job given more steps.
    """
    if checkpoint is None or not checkpoint.resume:
        return None
    events, starts = _events_and_starts(run_dir)
    if not starts:
        return None
    last = events[starts[-1]:]
    end = next((e for e in reversed(last) if e["event"] == "run_end"), None)
    lineage = next((e for e in last if e["event"] == "checkpoint_lineage"), None)
    if end is None or end.get("status") != "ok" or int(end.get("step") or 0) < steps:
        return None
    if lineage is None or not isinstance(lineage.get("lineage"), list):
        return None
    root = CheckpointRoot(checkpoint, run_dir)
    try:
        newest = lineage_checkpoints(root.root, lineage["lineage"], storage_options=root.options,
                                     attempts=checkpoint.storage_attempts).candidates
    except (OSError, ValueError, CheckpointError, StorageError):  # the job's start says why
        return None
    if not newest or newest[0].step < steps:
        return None
    return FinishedJob(step=newest[0].step, run_id=str(last[0]["run_id"]),
                       checkpoint=newest[0].path)
