"""One training job of a campaign, in its own process:
``python -m planaria.faults.campaign.job RUN.json``.

Its own process so that a whole-job SIGKILL takes the controller down too and
a crash cannot take the campaign down. RUN.json (see :func:`job_config`) holds
the planned run (its faults and its configuration, :class:`RunShape`) and the
incarnation (0, then 1 for the job started again after a whole-job fault).

The run's directory holds the campaign's files (``control/``, the injections,
the job logs, the final weights); the job's own run dir (``RunConfig.run_dir``:
events, ledger) is its ``job/`` subdirectory, which the campaign may mount as a
small tmpfs (a full disk), and the checkpoints go to ``faulty://RUN/checkpoints``.

The job trains as ``fit`` does (autonomous runs of steps, recovering in-process),
takes the final save as ``fit`` does, then writes every live member's final
model state, ``final-<worker>.safetensors`` (no pickle), and ``final.json``
naming them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

__all__ = ["FINAL_FILE", "JOB_DIR", "META_FILE", "final_file", "job_config", "main",
           "snapshot_file"]

FINAL_FILE = "final.json"
META_FILE = "campaign_job.json"
JOB_DIR = "job"
_log = logging.getLogger("planaria.faults.campaign")
FINISH_ATTEMPTS = 5
MAX_FAILURES = 40
"""Far more than a run's own faults (a few, two workers each at most): a runtime that
blames the workers for the work's fault (a bad sample evicting every rank in turn) ends
the job after this many, instead of after its timeout."""


def final_file(run_dir: Path, worker: str) -> Path:
    """A member's final model state."""
    return Path(run_dir) / f"final-{worker}.safetensors"


def snapshot_file(run_dir: Path, steps: int) -> Path:
    """A faulted run's weights after ``steps`` steps, taken before a fault is armed."""
    return Path(run_dir) / f"at-{steps}.safetensors"


def job_config(*, run_dir: Path, run: dict[str, Any], incarnation: int = 0) -> dict[str, Any]:
    """The RUN.json of one job (``run``: a PlannedRun's JSON)."""
    return {"run_dir": str(run_dir), "run": run, "incarnation": incarnation}


def _spec(shape: Any, step_s: float, control: Path) -> Any:
    from planaria.faults.campaign.knobs import CampaignLoss
    from planaria.faults.campaign.specs import build_spec

    spec = build_spec(shape.spec, control=str(control.resolve()))
    total = spec.global_batch_size // spec.micro_batch_size
    per_worker = -(-total // (shape.replicas * shape.workers_per_replica))
    loss = CampaignLoss(spec.loss, delay_s=step_s / max(1, per_worker),
                        control=str(control.resolve()))
    return dataclasses.replace(spec, loss=loss)


def _save(state: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    os.replace(tmp, path)


def _policy() -> Any:
    from planaria.control.policy import RecoveryPolicy

    options: dict[str, Any] = {}
    # A sample that cannot be read is skipped and recorded, not the job stopped: the
    # campaign's runs go on (the reference leaves the same sample out).
    if "on_work_fault" in {f.name for f in dataclasses.fields(RecoveryPolicy)}:
        options["on_work_fault"] = "skip"
    return RecoveryPolicy(on_nonfinite="rollback", max_failures=MAX_FAILURES, pause_timeout_s=180.0,
                          allow_restart_from_scratch=True, **options)


def member_states(job: Any) -> dict[str, dict[str, Any]]:
    """Every live member's model state (a sharded replica's leader gathers its shards)."""
    job.commit_all()
    refs = {h.name: h.actor.get_state.remote(job.gen) for h in job.members}
    answers = job.gather(refs, deadline_s=300, step=None)
    return {name: {k.removeprefix("model/"): v for k, v in tensors.items()
                   if k.startswith("model/")} for name, (tensors, _) in answers.items()}


def _finish(job: Any) -> dict[str, dict[str, Any]]:
    """As ``fit`` ends: the final save, then the final weights, recovering from a fault
    meanwhile (a worker can die after the last committed step: the survivors hold it)."""
    from planaria.faults.errors import ElasticRuntimeError, Failure

    for _ in range(FINISH_ATTEMPTS):
        try:
            if job.checkpointer is not None:
                job.checkpointer.save_final()
            return member_states(job)
        except Failure as failure:
            job.recovery.handle(failure)
    raise ElasticRuntimeError(f"could not read the final state in {FINISH_ATTEMPTS} attempts")


def run_job(cfg: dict[str, Any]) -> None:
    from planaria.checkpoint.config import CheckpointConfig
    from planaria.config import RunConfig
    from planaria.control.job import Job
    from planaria.faults.campaign.inject import Injector
    from planaria.faults.campaign.injected_job import InjectedJob
    from planaria.faults.campaign.mix import PlannedRun
    from planaria.faults.errors import Failure

    run_dir = Path(cfg["run_dir"])
    control = run_dir / "control"
    control.mkdir(parents=True, exist_ok=True)
    run = PlannedRun.from_json(cfg["run"])
    shape = run.shape
    spec = _spec(shape, run.step_s, control)
    job_dir = run_dir / JOB_DIR
    checkpoint = CheckpointConfig(
        root=f"faulty://{run_dir.resolve()}/checkpoints", every=shape.checkpoint_every,
        storage_options={"control": str(control.resolve())}, fsync=False, timeout_s=120.0,
    )
    config = RunConfig(steps=run.steps, replicas=shape.replicas, run_dir=job_dir,
                       ledger=shape.ledger, threads_per_worker=1,
                       workers_per_replica=shape.workers_per_replica, spares=shape.spares,
                       overlap_reduction=shape.overlap)
    with Job(spec, config, policy=_policy(), checkpoint=checkpoint) as job:
        import ray

        assert job.plan is not None
        meta = {"pid": os.getpid(), "pgid": os.getpgid(0), "incarnation": cfg["incarnation"],
                "gcs_address": str(ray.get_runtime_context().gcs_address),
                **job.plan.describe()}
        (run_dir / META_FILE).write_text(json.dumps(meta))

        def snapshot() -> None:
            _save(job.model_state_dict(), snapshot_file(run_dir, job.steps_done))

        _view: InjectedJob = job  # the type checker's proof that a Job is what it takes
        job.hooks.append(Injector(run, run_dir=run_dir, control=control, job_dir=job_dir,
                                  incarnation=int(cfg["incarnation"]), snapshot=snapshot))
        while job.steps_done < run.steps:  # bounded by the policy's max_failures
            try:
                # As fit() does: runs of steps between the boundaries (the injector names
                # its own, see Injector.next_step), so faults land in the autonomous loop.
                job.run_steps(run.steps)
            except Failure as failure:
                _log.warning("failure: %s", failure)
                job.recovery.handle(failure)
        states = _finish(job)
        steps = job.steps_done
    for name, state in states.items():
        _save(state, final_file(run_dir, name))
    tmp = run_dir / f"{FINAL_FILE}.tmp"
    tmp.write_text(json.dumps({"members": sorted(states), "steps": steps}))
    os.replace(tmp, run_dir / FINAL_FILE)


def main(argv: list[str] | None = None) -> int:
    from planaria.observe.logs import setup_logging

    argv = sys.argv[1:] if argv is None else argv
    setup_logging(0)
    cfg = json.loads(Path(argv[0]).read_text())
    try:
        run_job(cfg)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
