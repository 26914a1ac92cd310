"""One training job of a campaign, in its own process: ``python -m planaria.campaign.job RUN.json``.

Its own process so that a whole-job SIGKILL takes the controller down too and
a crash cannot take the campaign down. RUN.json (see :func:`job_config`) names
the spec, the width, the step length, the planned faults (none for the
reference) and the incarnation (0, then 1 for the resume after a whole-job
kill). It writes ``final.safetensors`` (the model weights, no pickle) and, for
the reference, ``ref-<steps>.safetensors`` at every step count asked for.
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

__all__ = ["FINAL_FILE", "META_FILE", "job_config", "main", "reference_file", "snapshot_file"]

FINAL_FILE = "final.safetensors"
META_FILE = "campaign_job.json"
_log = logging.getLogger("planaria.campaign")


def reference_file(run_dir: Path, steps: int) -> Path:
    return Path(run_dir) / f"ref-{steps}.safetensors"


def snapshot_file(run_dir: Path, steps: int) -> Path:
    """A faulted run's weights after ``steps`` steps, taken before a fault is armed."""
    return Path(run_dir) / f"at-{steps}.safetensors"


def job_config(
    *,
    target: str,
    run_dir: Path,
    steps: int,
    replicas: int,
    step_s: float,
    run: dict[str, Any] | None,
    incarnation: int = 0,
    checkpoint_every: int | None = None,
    snapshots: list[int] | None = None,
) -> dict[str, Any]:
    """The RUN.json of one job (``run``: a PlannedRun's JSON, None for the reference)."""
    return {"target": target, "run_dir": str(run_dir), "steps": steps, "replicas": replicas,
            "step_s": step_s, "run": run, "incarnation": incarnation,
            "checkpoint_every": checkpoint_every, "snapshots": snapshots or []}


def _spec(cfg: dict[str, Any], control: Path) -> Any:
    from planaria.campaign.knobs import CampaignLoss
    from planaria.cli import load_spec

    spec = load_spec(cfg["target"])
    per_rank = spec.global_batch_size / cfg["replicas"]
    micro_batches = max(1, -(-int(per_rank) // spec.micro_batch_size))
    delay = cfg["step_s"] / micro_batches
    loss = CampaignLoss(spec.loss, delay_s=delay, control=str(control))
    return dataclasses.replace(spec, loss=loss)


def _save(state: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    os.replace(tmp, path)


def run_job(cfg: dict[str, Any]) -> None:
    from planaria.campaign.inject import Injector
    from planaria.campaign.mix import PlannedRun
    from planaria.checkpointing import CheckpointConfig
    from planaria.config import RunConfig
    from planaria.controller import Job
    from planaria.errors import Failure
    from planaria.policy import RecoveryPolicy

    run_dir = Path(cfg["run_dir"])
    control = run_dir / "control"
    control.mkdir(parents=True, exist_ok=True)
    spec = _spec(cfg, control)
    steps, replicas = int(cfg["steps"]), int(cfg["replicas"])
    checkpoint = None
    if cfg["checkpoint_every"]:
        checkpoint = CheckpointConfig(
            root=f"faulty://{run_dir.resolve()}/checkpoints", every=int(cfg["checkpoint_every"]),
            storage_options={"control": str(control.resolve())}, fsync=False, timeout_s=120.0,
        )
    policy = RecoveryPolicy(on_nonfinite="rollback", max_failures=1000, pause_timeout_s=180.0)
    config = RunConfig(steps=steps, replicas=replicas, run_dir=run_dir, ledger=True,
                       threads_per_worker=1)
    snapshots = set(cfg["snapshots"])
    with Job(spec, config, policy=policy, checkpoint=checkpoint) as job:
        assert job.plan is not None
        meta = {"pid": os.getpid(), "pgid": os.getpgid(0), **job.plan.describe()}
        (run_dir / META_FILE).write_text(json.dumps(meta))
        if cfg["run"] is not None:
            def snapshot(job: Job) -> None:
                _save(job.model_state_dict(), snapshot_file(run_dir, job.steps_done))

            job.hooks.append(Injector(PlannedRun.from_json(cfg["run"]), run_dir=run_dir,
                                      control=control, replicas=replicas,
                                      incarnation=int(cfg["incarnation"]), snapshot=snapshot))
        while True:  # bounded by the policy's max_failures
            try:
                if job.steps_done >= steps:
                    state = job.model_state_dict()
                    break
                # As fit() does: runs of steps between the boundaries (the injector names
                # its own, see Injector.next_step), so faults land in the autonomous loop.
                job.run_steps(min((s for s in snapshots if s > job.steps_done), default=steps))
                if job.steps_done in snapshots:
                    snapshots.discard(job.steps_done)
                    _save(job.model_state_dict(), reference_file(run_dir, job.steps_done))
            except Failure as failure:
                _log.warning("failure: %s", failure)
                job.recovery.handle(failure)
    _save(state, run_dir / FINAL_FILE)


def main(argv: list[str] | None = None) -> int:
    from planaria.logs import setup_logging

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
