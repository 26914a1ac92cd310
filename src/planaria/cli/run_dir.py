"""``planaria run``'s run dir and checkpoint root: the checkpoint options as a
:class:`~planaria.checkpoint.config.CheckpointConfig`, the run's first line, and the checks
made before anything starts (a finished job, another run's checkpoints)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import Any

from planaria.checkpoint.config import CheckpointConfig
from planaria.faults.errors import ConfigError, StorageError

__all__ = ["before_start", "checkpoint_config", "checkpoint_line", "storage_options"]


def storage_options(pairs: list[str]) -> dict[str, Any]:
    """``--checkpoint-storage-option KEY=VALUE`` pairs as fsspec storage options (a VALUE
    that reads as JSON, such as true or 3, is taken as such)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"storage option {pair!r} is not valid: KEY=VALUE, e.g. "
                "endpoint_url=http://127.0.0.1:9000"
            )
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        options[key.strip()] = value
    return options


def checkpoint_config(args: argparse.Namespace) -> CheckpointConfig | None:
    """The checkpoint options as a CheckpointConfig; None when there is nothing to save or
    resume (``--checkpoint-every none --no-resume``)."""
    every = args.checkpoint_every
    if every is not None and str(every).strip().lower() in ("none", "off", "never"):
        every = None
    if every is None and args.no_resume:
        return None
    return CheckpointConfig.from_cli(
        every=every, resume=not args.no_resume, root=args.checkpoint_root,
        on_other_run=args.checkpoint_on_other_run,
        storage_options=storage_options(args.checkpoint_storage_option),
    )


def checkpoint_line(checkpoint: CheckpointConfig | None, run_dir: Path) -> str:
    """The run's first line: where checkpoints go (or that none are saved)."""
    if checkpoint is None or checkpoint.every is None:
        resume = (f"; resuming from those under {_root(checkpoint, run_dir)}"
                  if checkpoint is not None else "")
        return ("checkpoints: none saved (--checkpoint-every none): a crash of this process "
                f"retrains from step 0{resume}")
    resume = "resumes from the newest there" if checkpoint.resume else "no resume"
    every = str(checkpoint.every)
    every = f"{every} steps" if every.strip().isdigit() else every
    return (f"checkpoints: every {every} under {_root(checkpoint, run_dir)} "
            f"({resume}; --checkpoint-every none saves none)")


def _root(checkpoint: CheckpointConfig | None, run_dir: Path) -> str:
    root = (checkpoint.root if checkpoint is not None else None) or str(run_dir / "checkpoints")
    return root if "://" in root else os.path.abspath(root)


def before_start(run_dir: Path, steps: int, checkpoint: CheckpointConfig | None) -> str | None:
    """What the run dir and the checkpoint root say before Ray or a worker starts: a line
    saying the job finished already when it did (the command then exits 0; see
    :func:`~planaria.control.run_record.finished_job` for what finished means), else None;
    raises :class:`~planaria.checkpoint.errors.OtherRunCheckpoints` for a run that does not
    resume on a root holding checkpoints, unless ``--checkpoint-on-other-run`` says what to
    do with them (the refusal the job would meet once its workers started)."""
    from planaria.control.run_record import finished_job

    if checkpoint is not None and not checkpoint.resume and checkpoint.on_other_run == "refuse":
        from planaria.checkpoint.claim import refuse_other_runs
        from planaria.checkpoint.root import CheckpointRoot

        # A root this process cannot read is left to the job's own start to report.
        with contextlib.suppress(OSError, ValueError, StorageError):
            refuse_other_runs(CheckpointRoot(checkpoint, run_dir))
    done = finished_job(run_dir, steps, checkpoint)
    if done is None:
        return None
    return (f"run dir {run_dir}: the job finished at step {done.step} (run {done.run_id}; "
            f"checkpoint {done.checkpoint}); nothing to do — give more --steps to train on, "
            "or a new --run-dir (or --no-resume --checkpoint-on-other-run overwrite) to start "
            "over")
