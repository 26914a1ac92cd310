"""Mixed precision as users run it: bf16 autocast, and fp16 with a GradScaler whose
overflowing steps are skipped on every replica alike and whose state travels to joiners
and through checkpoints. Each run's final state equals a fault-free one-replica run."""

from __future__ import annotations

import sys

import pytest
import ray
import torch

import planaria
from planaria import fit
from planaria.checkpoint.config import CheckpointConfig
from planaria.examples import mlp
from tests.assertions import assert_exactly_once, assert_same_state, drive, events, of

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

N, G, STEPS = 256, 32, 16  # 8 steps an epoch: the marked sample's step comes twice


class _Marked(mlp.Regression):
    def __init__(self) -> None:
        super().__init__(n=N)
        self.y[11] = 1000.0


def _overflowing_loss(model, batch):
    """mse; a batch holding the marked sample has a loss so large that its float16
    gradient overflows once scaled, while the loss itself stays finite (in float32)."""
    loss = mlp.mse(model, batch)
    if bool((batch[1] > 100).any()):
        loss = loss * 1e6
    return loss


def _spec(precision: str) -> planaria.TrainSpec:
    return planaria.TrainSpec(
        model=mlp.make_model,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        loss=_overflowing_loss if precision == "fp16" else mlp.mse,
        dataset=_Marked if precision == "fp16" else (lambda: mlp.Regression(n=N)),
        global_batch_size=G,
        micro_batch_size=8,
        grad_clip_norm=1.0,
        precision=precision,
    )


def _scalers(job) -> list[dict]:
    """Every member's GradScaler state (after the pending step is applied)."""
    job.commit_all()
    return [ray.get(h.actor.state_meta.remote(job.gen)).meta["grad_scaler"]
            for h in job.members]


@pytest.fixture(scope="module")
def fp16_reference(tmp_path_factory, ray_cluster):
    run_dir = tmp_path_factory.mktemp("ref16")
    with planaria.Job(_spec("fp16"), planaria.RunConfig(steps=STEPS, replicas=1,
                                                         run_dir=run_dir)) as job:
        drive(job, STEPS)
        (scaler,) = _scalers(job)
        state = job.model_state_dict()
    return state, [e["step"] for e in of(events(run_dir), "step_overflow")], scaler


def test_precision_is_checked():
    with pytest.raises(planaria.ConfigError, match="precision"):
        _spec("fp8")


def test_bf16_at_two_replicas_equals_one(tmp_path):
    one = fit(_spec("bf16"), steps=6, replicas=1, run_dir=tmp_path / "one").state_dict
    two = fit(_spec("bf16"), steps=6, replicas=2, run_dir=tmp_path / "two").state_dict
    assert_same_state(one, two, atol=1e-3, rtol=1e-3)  # bf16 forwards, summed in float32


@pytest.mark.extended  # fp16 also runs in tests/worker/test_gpu.py; -m extended runs it here
def test_fp16_overflows_skip_alike_and_the_scale_travels(tmp_path, fp16_reference):
    """The marked sample's steps overflow: every replica skips them and halves its scale.
    A kill after the first overflow, whose replacement hot-joins (it receives the scale),
    then every replica lost, restored from a checkpoint (the scale comes back with it). A
    joiner or a restore that missed the scale would sum gradients scaled differently and
    end elsewhere."""
    reference, overflows, final_scaler = fp16_reference
    assert final_scaler["scale"] == 65536.0 / 4  # backed off at each overflow
    assert len(overflows) == 2 and overflows[0] < 8 <= overflows[1]
    job = planaria.Job(
        _spec("fp16"),
        planaria.RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True),
        chaos=planaria.ChaosPlan.parse(
            "kill:w1@step9,kill:w0@step13,kill:w2@step13,kill:w3@step13"),
        checkpoint=CheckpointConfig(every=2, fsync=False),
    )
    joined: list[dict] = []

    def check_the_joiner_got_the_scale(job) -> None:
        if job.steps_done == 11 and not joined:
            joined.extend(_scalers(job))
            assert len(joined) == 3 and all(s == joined[0] for s in joined), joined

    with job:
        # w3 joins before the second kill (steps 11 and 12 are computed with it)
        drive(job, STEPS, wait_width_at=11, before=check_the_joiner_got_the_scale)
        state = job.model_state_dict()
        # Every replica was lost: the restore goes on with the first replacement ready, and
        # steps of milliseconds can end before the others join. They join now, from it.
        assert job.wait_for_width(3, timeout_s=120) == 3
        assert _scalers(job) == [final_scaler] * 3  # the restore brought the scale back
    assert_same_state(reference, state, atol=1e-4, rtol=1e-3)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    # (a step re-run after the restore overflows again)
    assert sorted({e["step"] for e in of(evs, "step_overflow")}) == overflows
    assert not of(evs, "step_skipped")  # an overflow is not a non-finite fault
    assert of(evs, "joined")[0]["worker"] == "w3"
    (restore,) = of(evs, "restore")
    assert restore["step"] > 9  # from a checkpoint the joiner helped write
