"""``fit()``: train a spec to a number of steps, recovering from failures in-process."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from planaria.checkpoint.config import CheckpointConfig
from planaria.checkpoint.coordinator import Checkpointer
from planaria.config import RunConfig, TrainSpec, local_run_dir
from planaria.control.job import Job, StepResult
from planaria.control.policy import HangConfig, RecoveryPolicy
from planaria.faults.chaos import ChaosPlan
from planaria.faults.errors import CheckpointError, ElasticRuntimeError, Failure, FinalSaveFailed
from planaria.observe.events import EVENTS_FILE
from planaria.observe.loss_history import LossHistory
from planaria.observe.progress import ProgressDisplay
from planaria.observe.trackers import Tracker, TrackerFeed, TrackerOptions, build_trackers
from planaria.wire.evaluation import EvalResult

__all__ = ["FitResult", "fit"]


@dataclass
class FitResult:
    """What a finished run leaves: its last step, loss history, event log and final weights."""

    final_step: int
    """Steps committed (the next step would be this one)."""
    losses: LossHistory
    """(step, loss) of every committed step of this run, in commit order (a step computed
    again after a restore appears again); a sequence of tuples, stored as two arrays
    (``losses.steps``, ``losses.values``): 16 bytes a step."""
    events_path: Path
    state_dict: dict[str, torch.Tensor] = field(repr=False)
    """The final model state (CPU tensors)."""
    run_dir: Path = Path()
    evals: list[EvalResult] = field(default_factory=list)
    """Every evaluation of this run (``RunConfig.eval_every``), one per step, in step order."""


def fit(
    spec: TrainSpec,
    *,
    steps: int,
    replicas: int,
    run_dir: str | Path,
    address: str | None = None,
    policy: RecoveryPolicy | None = None,
    hang: HangConfig | None = None,
    chaos: ChaosPlan | str | None = None,
    checkpoint: CheckpointConfig | None = None,
    on_step: Callable[[StepResult], None] | None = None,
    listeners: Sequence[Callable[[dict[str, Any]], None]] = (),
    loggers: Sequence[str | Tracker] = (),
    tracker_options: TrackerOptions | None = None,
    progress: bool | None = None,
    **options: Any,
) -> FitResult:
    """Trains ``spec`` on ``replicas`` workers until ``steps`` steps are committed.

    Failures are recovered from in this process according to ``policy``; a bug
    in the user's code stops the run with its original traceback
    (:class:`~planaria.faults.errors.UserCodeError`), and a spent budget raises
    :class:`~planaria.faults.errors.ElasticRuntimeError`. ``options`` are further
    :class:`~planaria.config.RunConfig` fields (``ledger``, ``cpus_per_worker``, ...).
    ``on_step`` is called with each step as it commits (while its run of steps goes on,
    on this thread: a step's record comes once the next step is applied, at most every
    0.25 s; a step computed again after a restore is called again; an exception
    it raises ends the job). ``checkpoint`` is a :class:`~planaria.CheckpointConfig`; ``listeners``
    receive every event record as it is logged (progress display, Prometheus). A final
    save that does not commit raises :class:`~planaria.faults.errors.FinalSaveFailed` with the
    job left open (``err.job``): save its state elsewhere (``err.job.save(root=...)``),
    then close it (``err.job.close()``).

    ``loggers``: experiment trackers fed live from the event stream, by name
    (``"tensorboard"``, ``"wandb"``, ``"mlflow"``, ``"csv"``, written under
    ``RUN_DIR/trackers/<name>`` unless ``tracker_options`` say otherwise) or as
    :class:`~planaria.observe.trackers.Tracker` objects; they are closed when ``fit`` returns
    or raises, and one that raises is disabled without stopping the run.

    ``progress``: draw planaria's progress bar (:class:`~planaria.observe.progress.ProgressDisplay`:
    step, loss, replicas, samples/s, ETA; recovery lines and log records printed above it)
    and a summary line at the end. ``None`` (the default): only when stdout is a terminal;
    ``False``: never; ``True``: also on a pipe, as plain lines.
    """
    if progress is not False:
        display = _display(steps, replicas, run_dir, forced=progress is True)
        if display is not None:
            display.start()
            try:
                return fit(spec, steps=steps, replicas=replicas, run_dir=run_dir,
                           address=address, policy=policy, hang=hang, chaos=chaos,
                           checkpoint=checkpoint, on_step=on_step,
                           listeners=[*listeners, display], loggers=loggers,
                           tracker_options=tracker_options, progress=False, **options)
            finally:
                display.stop()
    if loggers:
        run_path = local_run_dir(run_dir)
        feed = TrackerFeed(build_trackers(loggers, run_path, tracker_options))
        try:
            return fit(spec, steps=steps, replicas=replicas, run_dir=run_path, address=address,
                       policy=policy, hang=hang, chaos=chaos, checkpoint=checkpoint,
                       on_step=on_step, listeners=[*listeners, feed], **options)
        finally:
            feed.close()
    config = RunConfig(
        steps=steps, replicas=replicas, run_dir=local_run_dir(run_dir), address=address, **options
    )
    plan = ChaosPlan.parse(chaos, seed=spec.seed) if isinstance(chaos, str) else chaos
    job = Job(
        spec,
        config,
        policy=policy,
        hang=hang,
        chaos=plan,
        checkpoint=checkpoint,
        listeners=listeners,
    )
    if on_step is not None:  # as each step commits, not when its run of steps ends
        job.commit_log.step_callbacks.append(on_step)
    with contextlib.ExitStack() as stack:
        stack.enter_context(job)
        while job.steps_done < steps:
            try:
                job.run_steps(steps)
            except Failure as failure:
                job.recovery.handle(failure)
        try:
            state = _finish(job)
        except FinalSaveFailed:
            stack.pop_all()  # the job stays open, its workers holding the trained state
            raise
        return FitResult(
            final_step=job.steps_done,
            losses=job.losses,
            events_path=job.run_dir / EVENTS_FILE,
            state_dict=state,
            run_dir=job.run_dir,
            evals=list(job.evaluation.results),
        )


def _display(steps: int, replicas: int, run_dir: str | Path, *,
             forced: bool) -> ProgressDisplay | None:
    """fit's progress display: on a terminal, or anywhere when ``forced``."""
    display = ProgressDisplay(steps, replicas, summary="line",
                              events_path=local_run_dir(run_dir) / EVENTS_FILE)
    return display if forced or display.terminal else None


def _finish(job: Job, attempts: int = 5) -> dict[str, torch.Tensor]:
    """The last evaluation if due, the final save and the final weights, recovering from a
    fault meanwhile (a worker can die after the last committed step too: the survivors
    hold the state)."""
    for _ in range(attempts):
        try:
            job.evaluation.if_due()
            if job.checkpointer is not None:
                _save_final(job, job.checkpointer)
            state = job.model_state_dict()
            break
        except Failure as failure:
            job.recovery.handle(failure)
    else:
        raise ElasticRuntimeError(f"could not read the final state in {attempts} attempts")
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise ElasticRuntimeError(
            f"the final weights are not finite ({', '.join(bad[:5])}): the run diverged; "
            "use RecoveryPolicy(on_nonfinite='rollback') with checkpoints, or 'abort'"
        )
    return state


def _save_final(job: Job, ckpt: Checkpointer) -> None:
    """The final save; a failure to commit it is :class:`FinalSaveFailed`, which keeps the
    job open: its workers still hold the trained state, which the caller can save
    elsewhere (``err.job.save(root=...)``) before closing the job."""
    try:
        ckpt.save_final()
    except CheckpointError as err:
        if isinstance(err, FinalSaveFailed):
            raise
        newest = (f"step {ckpt.last_committed} ({ckpt.last_path})"
                  if ckpt.last_committed is not None else "none")
        job.log.emit("final_save_failed", step=job.steps_done, root=ckpt.root, error=str(err),
                     newest_step=ckpt.last_committed, newest_path=ckpt.last_path)
        raise FinalSaveFailed(
            f"{err}. The trained state of step {job.steps_done} is still in the workers and "
            f"the job is still open: save it elsewhere with err.job.save(root=...) (or, once "
            f"{ckpt.root} has room, err.job.save()), then err.job.close(); the newest durable "
            f"checkpoint is {newest}",
            job=job, step=job.steps_done, newest_step=ckpt.last_committed,
            newest_path=ckpt.last_path,
        ) from err
