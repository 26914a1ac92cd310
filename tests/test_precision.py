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
from planaria.checkpointing import CheckpointConfig
from planaria.examples import mlp
from tests.assertions import assert_exactly_once, assert_same_state, events, of

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


@pytest.fixture(scope="module")
def fp16_reference(tmp_path_factory, ray_cluster):
    run_dir = tmp_path_factory.mktemp("ref16")
    state = fit(_spec("fp16"), steps=STEPS, replicas=1, run_dir=run_dir).state_dict
    return state, [e["step"] for e in of(events(run_dir), "step_overflow")]


def test_precision_is_checked():
    with pytest.raises(planaria.ConfigError, match="precision"):
        _spec("fp8")


def test_bf16_at_two_replicas_equals_one(tmp_path):
    one = fit(_spec("bf16"), steps=6, replicas=1, run_dir=tmp_path / "one").state_dict
    two = fit(_spec("bf16"), steps=6, replicas=2, run_dir=tmp_path / "two").state_dict
    assert_same_state(one, two, atol=1e-3, rtol=1e-3)  # bf16 forwards, summed in float32


@pytest.mark.parametrize("fault", ["hot_join", "restore"])
def test_fp16_overflows_skip_alike_and_the_scale_travels(tmp_path, fp16_reference, fault):
    """The marked sample's steps overflow: every replica skips them and halves its scale.
    A joiner that missed the scale (or a restore that dropped it) would sum gradients
    scaled differently and end elsewhere."""
    reference, overflows = fp16_reference
    assert len(overflows) == 2 and overflows[0] < 8 <= overflows[1]
    kill = 9 if fault == "hot_join" else 11  # after the first overflow in either case
    chaos = (f"kill:w1@step{kill}" if fault == "hot_join"
             else f"kill:w0@step{kill},kill:w1@step{kill},kill:w2@step{kill}")
    job = planaria.Job(
        _spec("fp16"),
        planaria.RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True),
        chaos=planaria.ChaosPlan.parse(chaos),
        checkpoint=CheckpointConfig(every=2, fsync=False) if fault == "restore" else None,
    )
    with job:
        while job.steps_done < STEPS:
            try:
                if fault == "hot_join" and job.steps_done == 13:
                    job.wait_for_width(3, timeout_s=180)  # the joiner computes steps 13-15
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        state = job.model_state_dict()
    assert_same_state(reference, state, atol=1e-4, rtol=1e-3)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    # (a step re-run after the restore overflows again)
    assert sorted({e["step"] for e in of(evs, "step_overflow")}) == overflows
    assert not of(evs, "step_skipped")  # an overflow is not a non-finite fault
    actions = [a["action"] for a in of(evs, "action")]
    assert ("restore" in actions) == (fault == "restore")
    if fault == "hot_join":
        assert [e["worker"] for e in of(evs, "joined")] == ["w3"]
