"""A recorded event stream for the tracker tests: four steps, a fault and its recovery (the
step computed again), a checkpoint and an evaluation."""

from __future__ import annotations

from typing import Any


def _ev(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "event": event, **fields}


def _step(t: float, step: int, loss: float) -> dict[str, Any]:
    return _ev(t, "step_committed", step=step, gen=0, width=2, duration_s=0.5, loss=loss,
               samples=8, samples_per_s=16.0, data_wait_s=0.0, metrics={"acc": 0.25 * step},
               lr=0.1, grad_norm=1.0 + step)


STREAM: list[dict[str, Any]] = [
    _ev(100.0, "run_start", run_id="r1", replicas=2, steps=4),
    _step(101.0, 0, 2.0),
    _step(102.0, 1, 1.5),
    _ev(102.5, "fault", fault_id="f1", kind="worker_lost", worker="w1", step=2, fault_t=102.4,
        message="died"),
    _ev(102.5, "detected", fault_id="f1", kind="worker_lost", worker="w1", detect_s=0.1),
    _step(103.0, 1, 1.4),  # computed again after the restore
    _ev(103.0, "recovered", fault_id="f1", step=1, recover_s=0.6, lost_steps=1),
    _ev(103.2, "checkpoint_saved", step=1, path="/x", bytes=10, stall_s=0.01, save_s=0.2),
    _step(104.0, 2, 1.0),
    _step(105.0, 3, float("nan")),  # a non-finite loss is left out, the rest logged
    _ev(105.5, "eval", step=4, metrics={"loss": 0.9}, samples=16, seconds=0.1, width=2),
    _ev(106.0, "run_end", status="ok", step=4),
]
STEP_LOSSES = [(0, 2.0), (1, 1.5), (1, 1.4), (2, 1.0)]
