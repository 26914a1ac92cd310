"""The GPU path: recovery with CUDA state (skipped, with the reason, without a GPU).

On a machine with one GPU the workers share it (``gpus_per_worker`` < 1) and talk
over gloo, which reduces CUDA tensors itself: NCCL cannot put two ranks on one
device. With three GPUs or more each worker has its own and the group is NCCL.
Either way the state lives on the GPU beside Adam's host-side step counters, every
transfer between them is staged, and each test's final parameters equal a
fault-free run on the same device, with every sample used exactly once.
``bench/gpu_check.sh`` runs these tests and the GPU benchmarks in one go.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time

import pytest
import ray
import torch

import planaria
from planaria import HangConfig, Job, RunConfig, fit
from planaria.checkpoint.config import CheckpointConfig
from planaria.examples import mlp
from planaria.wire import store_keys
from planaria.wire.heartbeat import Heartbeat
from tests.assertions import assert_exactly_once, assert_same_state, drive, events, of

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.skipif(GPUS == 0, reason="no CUDA device here: run bench/gpu_check.sh on a "
                       "GPU machine"),
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.usefixtures("ray_cluster"),
]

N, G, STEPS = 512, 64, 16
FAST_HANG = HangConfig(heartbeat_timeout_s=2.5, floor_s=3.0, heartbeat_s=0.1)


def gpu_options() -> dict:
    """Three workers and a replacement: a GPU each where there are enough, else one shared."""
    if GPUS >= 4:
        return {"use_gpu": True}
    return {"use_gpu": True, "gpus_per_worker": 0.2, "backend": "gloo"}


def spec(**kw) -> planaria.TrainSpec:
    # Adam: its step counters stay on the host, the rest on the GPU
    return dataclasses.replace(mlp.make_spec(n=N), **kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ray_cluster):
    return fit(spec(), steps=STEPS, replicas=1, run_dir=tmp_path_factory.mktemp("ref"),
               **gpu_options()).state_dict


def run(run_dir, chaos: str = "", *, hang=None, checkpoint=None, during=None, spec_=None):
    job = Job(
        spec_ or spec(),
        RunConfig(steps=STEPS, replicas=3, run_dir=run_dir, ledger=True, **gpu_options()),
        chaos=planaria.ChaosPlan.parse(chaos) if chaos else None,
        hang=hang,
        checkpoint=checkpoint,
    )
    with job:
        if during is not None:
            during(job)
        drive(job, STEPS, wait_width_at=STEPS - 3)
        state = job.model_state_dict()
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=STEPS)
    return state, events(run_dir)


def test_config_refuses_nccl_on_a_shared_gpu(tmp_path):
    with pytest.raises(planaria.ConfigError, match="NCCL cannot put two ranks on one GPU"):
        RunConfig(steps=1, replicas=2, run_dir=tmp_path, use_gpu=True, gpus_per_worker=0.5,
                  backend="nccl")


def test_hot_join_with_adamw_state_on_the_gpu(tmp_path, reference):
    adamw = spec(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01))
    ref = fit(adamw, steps=STEPS, replicas=1, run_dir=tmp_path / "ref", **gpu_options())
    state, evs = run(tmp_path / "run", "kill:w1@step5", spec_=adamw)
    assert_same_state(ref.state_dict, state)
    assert [e["worker"] for e in of(evs, "joined")] == ["w3"]
    assert of(evs, "step_committed")[-1]["width"] == 3


@pytest.mark.parametrize("strategy", ["share", "read_all", "s3"])
def test_restore_of_gpu_state(tmp_path, reference, strategy, request):
    """Every replica lost: the checkpoint is read back into host memory and onto the GPU,
    by every replica (read_all) or a share each, broadcast to the others (share; the
    automatic choice on an object store: s3, a real S3-compatible server on loopback)."""
    if strategy == "s3":
        options = request.getfixturevalue("s3_options")
        checkpoint = CheckpointConfig(root=f"s3://planaria-ckpt/gpu-{tmp_path.name}", every=3,
                                      storage_options=options)
    else:
        checkpoint = CheckpointConfig(every=3, fsync=False, restore_strategy=strategy)
    state, evs = run(tmp_path, "kill:w0@step8,kill:w1@step8,kill:w2@step8",
                     checkpoint=checkpoint)
    assert_same_state(reference, state)
    assert [a["action"] for a in of(evs, "action")][:1] == ["restore"]
    (restore,) = of(evs, "restore")
    assert restore["strategy"] == ("share" if strategy == "s3" else strategy)


def test_a_hung_worker_in_the_collective_is_cut_off(tmp_path, reference):
    """SIGSTOP: the survivors wait in the all-reduce until the hang is detected; their
    groups are aborted and they go on with a replacement."""
    state, evs = run(tmp_path, "hang:w0@step6", hang=FAST_HANG)
    assert_same_state(reference, state)
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_hung"]


def _slow_on_marked(model, batch):
    """mse; the rank whose batch holds the marked sample computes 1.5 s longer, so that its
    peers wait for it in the all-reduce."""
    if bool((batch[1] > 100).any()):
        time.sleep(1.5)
    return mlp.mse(model, batch)


class _Marked(mlp.Regression):
    def __init__(self) -> None:
        super().__init__(n=N)
        self.y[11] = 150.0


def test_a_kill_mid_allreduce(tmp_path):
    """A worker killed while it waits in the all-reduce for a slower peer."""
    marked = spec(loss=_slow_on_marked, dataset=_Marked)
    ref = fit(marked, steps=STEPS, replicas=1, run_dir=tmp_path / "ref", **gpu_options())
    killed: list[str] = []

    def kill_one_in_reduce(job):
        def watch():
            end = time.time() + 120
            while not killed and time.time() < end:
                for h in list(job.members):
                    key = store_keys.heartbeat(h.name)
                    raw = job.store.get(key) if job.store.check([key]) else None
                    if raw and Heartbeat.parse(raw).phase == "reduce" and h.pid:
                        killed.append(h.name)
                        os.kill(h.pid, signal.SIGKILL)
                        return
                time.sleep(0.02)

        threading.Thread(target=watch, daemon=True).start()

    state, evs = run(tmp_path / "run", during=kill_one_in_reduce, spec_=marked)
    assert killed, "no worker was seen waiting in the all-reduce"
    assert_same_state(ref.state_dict, state)
    assert [f["worker"] for f in of(evs, "fault")] == killed


def test_fp16_with_a_grad_scaler_on_the_gpu(tmp_path):
    """fp16 autocast and a GradScaler on CUDA: a kill and a hot-join give the same weights
    as one replica (the joiner receives the scale)."""
    fp16 = spec(precision="fp16")
    ref = fit(fp16, steps=STEPS, replicas=1, run_dir=tmp_path / "ref", **gpu_options())
    state, evs = run(tmp_path / "run", "kill:w2@step4", spec_=fp16)
    assert_same_state(ref.state_dict, state, atol=1e-4, rtol=1e-3)
    assert of(evs, "joined")


@pytest.mark.skipif(GPUS < 2, reason="NCCL needs a GPU per rank: this machine has "
                    f"{GPUS}; the shared-GPU tests above run over gloo")
def test_nccl_group_survives_a_peer_kill(tmp_path):
    """Two workers on two GPUs over NCCL: one killed, the survivor's communicator is
    aborted (not shut down, which would wait on the dead peer) and it goes on alone."""
    base = spec()
    ref = fit(base, steps=STEPS, replicas=1, run_dir=tmp_path / "ref", use_gpu=True)
    job = Job(base, RunConfig(steps=STEPS, replicas=2, run_dir=tmp_path / "run", ledger=True,
                              use_gpu=True), chaos=planaria.ChaosPlan.parse("kill:w1@step5"))
    with job:
        drive(job, STEPS)
        state = job.model_state_dict()
    assert_same_state(ref.state_dict, state)
    assert of(events(tmp_path / "run"), "run_start")[0]["config"]["backend"] == "nccl"
