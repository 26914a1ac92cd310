"""A fault of the work (a sample, a micro-batch) is not a fault of a worker, and busy is not hung.

Real workers. A sample whose ``dataset[i]`` raises ``OSError`` every time moves to another
worker once and is then the work's: the job stops with a save and an error naming it, or,
where the policy skips such work, trains on without it, evicting no one. A sample that takes
seconds to load and a micro-batch that computes for seconds, in steps of milliseconds, are
busy: no one is evicted. A real death, twice at the same step, is the workers' (both go).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch

import planaria
from planaria import HangConfig, Job, RecoveryPolicy, RunConfig
from planaria.checkpoint.config import CheckpointConfig
from planaria.data.integrity import dataset_fingerprint
from planaria.data.plan import DataPlan
from planaria.examples import mlp
from tests.assertions import assert_exactly_once, assert_same_state, events, of
from tests.assertions import run_to as drive
from tests.loop_faults import SignalSelfAt, install

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

N, G, MBS, STEPS = 256, 48, 8, 6
SEED = 0
FAST_HANG = HangConfig(floor_s=1.0, heartbeat_s=0.1, heartbeat_timeout_s=3.0)


def pick_sample(step: int, position: int) -> int:
    """A sample of step ``step``'s batch that the dataset fingerprint does not read at start."""
    fingerprinted = set(dataset_fingerprint(mlp.Regression(n=N, seed=SEED), SEED)["positions"])
    batch = [int(i) for i in DataPlan(N, G, SEED).batch(step)]
    return next(i for i in batch[position:] + batch if i not in fingerprinted)


class Poisoned(torch.utils.data.Dataset):
    """mlp's regression data, but ``dataset[bad]`` raises OSError (a truncated image)."""

    def __init__(self, bad: int) -> None:
        self.inner = mlp.Regression(n=N, seed=SEED)
        self.bad = bad

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        if i == self.bad:
            raise OSError("image file is truncated (3 bytes not processed)")
        return self.inner[i]


class SlowSample(torch.utils.data.Dataset):
    """mlp's regression data; ``dataset[slow]`` takes ``seconds`` (a read from a slow disk)."""

    def __init__(self, slow: int, seconds: float) -> None:
        self.inner = mlp.Regression(n=N, seed=SEED)
        self.slow, self.seconds = slow, seconds

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        if i == self.slow:
            time.sleep(self.seconds)
        return self.inner[i]


class DieOnRerun:
    """At ``step``, once its gradient is computed: this worker dies by SIGKILL, but only in a
    later generation than ``gen`` (the step's re-run after a first death)."""

    def __init__(self, step: int, gen: int) -> None:
        self.step, self.gen = step, gen

    def __call__(self, worker, step: int, phase: str) -> None:
        if phase == "computed" and step == self.step and worker.membership.gen > self.gen:
            os.kill(os.getpid(), 9)


class HeavyLoss:
    """mse; a micro-batch holding sample ``heavy`` first computes for ``seconds`` (burning CPU
    in real matrix products, as a long sequence would)."""

    def __init__(self, heavy: int, seconds: float) -> None:
        self.heavy, self.seconds = heavy, seconds

    def __call__(self, model, batch):
        x, _ = batch
        if bool((x[:, 0] == self.marker_value()).any()):
            end = time.monotonic() + self.seconds
            a = torch.randn(256, 256)
            while time.monotonic() < end:
                a = torch.tanh(a @ a)
        return mlp.mse(model, batch)

    def marker_value(self) -> float:
        return float(mlp.Regression(n=N, seed=SEED).x[self.heavy, 0])


class StallOnce:
    """mse; the first time a micro-batch holds sample ``at``, the thread blocks for good (a
    deadlock) while the heartbeat lives: marker file ``marker`` says it happened."""

    def __init__(self, at: int, marker: str, every_time: bool = False) -> None:
        self.at, self.marker, self.every_time = at, marker, every_time

    def __call__(self, model, batch):
        x, _ = batch
        value = float(mlp.Regression(n=N, seed=SEED).x[self.at, 0])
        if bool((x[:, 0] == value).any()) and (self.every_time or not os.path.exists(self.marker)):
            Path(self.marker).write_text(str(os.getpid()))
            threading.Event().wait()  # never set
        return mlp.mse(model, batch)


def spec_with(*, dataset=None, loss=None) -> planaria.TrainSpec:
    base = mlp.make_spec(n=N, global_batch_size=G, micro_batch_size=MBS, seed=SEED)
    return planaria.TrainSpec(
        model=base.model, optimizer=base.optimizer, loss=loss or base.loss,
        dataset=dataset or base.dataset, global_batch_size=G, micro_batch_size=MBS,
        grad_clip_norm=base.grad_clip_norm, seed=SEED, name="mlp",
    )




def reference(run_dir: Path, *, skipped: set[int] = frozenset()) -> dict:
    job = Job(spec_with(), RunConfig(steps=STEPS, replicas=3, run_dir=run_dir))
    job.skipped_samples.update(skipped)  # as if skipped from the start (the sample is not
    with job:                            # in any batch before the step that skips it)
        return drive(job, STEPS)


def widths(evs: list[dict]) -> list[int]:
    return [e["world_size"] for e in of(evs, "generation")]




def test_a_poison_sample_stops_the_job_with_a_save_and_names_the_sample(tmp_path):
    bad = pick_sample(3, 20)
    job = Job(spec_with(dataset=lambda: Poisoned(bad)),
              RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True),
              checkpoint=CheckpointConfig(every=2))
    with pytest.raises(planaria.WorkFault) as err, job:
        drive(job, STEPS)
    assert f"sample {bad}" in str(err.value) and "on_work_fault='skip'" in str(err.value)
    assert isinstance(err.value, planaria.UserCodeError)  # the user's data, not infrastructure
    evs = events(tmp_path)
    assert set(widths(evs)) == {3}, "a healthy worker was evicted"
    faults = of(evs, "fault")
    assert [f["kind"] for f in faults] == ["infrastructure_error", "work_fault"]
    assert faults[0]["worker"] and faults[1]["worker"] is None
    assert len(set(faults[1]["seen_on"])) == 2  # it followed the sample to a second worker
    assert [a["action"] for a in of(evs, "action")] == ["retry_elsewhere", "abort"]
    saved = of(evs, "checkpoint_saved")
    assert saved[-1]["reason"] == "work_fault" and saved[-1]["step"] == 3  # 3 steps kept


@pytest.mark.parametrize("k", [1, pytest.param(2, marks=pytest.mark.extended)],
                         ids=["replicas", "sharded-replicas"])
def test_a_poison_sample_is_skipped_when_the_policy_says_so(tmp_path, k):
    """Also in sharded replicas (2 x 2), whose workers agree after each load that every one
    of them loaded: the replica stays whole, and the sample runs on the other replica."""
    bad = pick_sample(3, 20)
    ref = reference(tmp_path / "ref", skipped={bad})
    run = tmp_path / "run"
    job = Job(spec_with(dataset=lambda: Poisoned(bad)),
              RunConfig(steps=STEPS, replicas=3 if k == 1 else 2, workers_per_replica=k,
                        run_dir=run, ledger=True),
              policy=RecoveryPolicy(on_work_fault="skip"))
    with job:
        state = drive(job, STEPS)
    assert_same_state(ref, state)
    assert_exactly_once(run, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run)
    assert not of(evs, "hang_stack") and not of(evs, "replacement_requested")  # none evicted
    assert of(evs, "sample_skipped")[0]["samples"] == [bad]
    assert set(widths(evs)) == {3 if k == 1 else 2}


def test_a_second_real_death_at_the_same_step_is_the_workers(tmp_path):
    ref = reference(tmp_path / "ref")
    run = tmp_path / "run"
    job = Job(spec_with(), RunConfig(steps=STEPS, replicas=3, run_dir=run, ledger=True))
    with job:
        # w1 dies at step 3 once it has computed (before the reduction), w2 at that step's
        # re-run in the next generation.
        install(job, "w1", SignalSelfAt(3, "computed", 9, str(tmp_path / "w1-killed")))
        install(job, "w2", DieOnRerun(3, job.gen))
        state = drive(job, STEPS)
    assert_same_state(ref, state)
    assert_exactly_once(run, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run)
    faults = of(evs, "fault")
    assert [(f["kind"], f["worker"], f["step"]) for f in faults] == [
        ("worker_lost", "w1", 3), ("worker_lost", "w2", 3)]  # both evicted, as workers' faults
    assert not of(evs, "attribution")  # deaths are never the work's


def busy_run(tmp_path, spec: planaria.TrainSpec, **options) -> None:
    """Trains ``spec`` (one slow load, or one heavy micro-batch, in steps of milliseconds
    with a step deadline of 1 s) and checks no one was evicted: busy is not hung."""
    ref = reference(tmp_path / "ref")
    run = tmp_path / "run"
    job = Job(spec, RunConfig(steps=STEPS, replicas=3, run_dir=run, ledger=True, **options),
              hang=FAST_HANG)
    with job:
        state = drive(job, STEPS)
    assert_same_state(ref, state)
    assert_exactly_once(run, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run)
    assert not of(evs, "fault") and set(widths(evs)) == {3}


@pytest.mark.parametrize("prefetch", [True, pytest.param(False, marks=pytest.mark.extended)],
                         ids=["loader-thread", "inline"])
def test_a_sample_that_takes_seconds_to_load_is_busy_not_hung(tmp_path, prefetch):
    # The 4 s load is judged by the I/O deadline, not the step's.
    slow = pick_sample(2, 10)
    busy_run(tmp_path, spec_with(dataset=lambda: SlowSample(slow, 4.0)), prefetch=prefetch)


def test_a_micro_batch_that_computes_for_seconds_is_busy_not_hung(tmp_path):
    # Its thread burns CPU for 4 s: busy beats, though no micro-batch ends.
    busy_run(tmp_path, spec_with(loss=HeavyLoss(pick_sample(2, 10), 4.0)))


def test_a_stalled_thread_is_evicted_once_and_its_work_runs_on(tmp_path):
    at = pick_sample(2, 10)
    ref = reference(tmp_path / "ref")
    run = tmp_path / "run"
    job = Job(spec_with(loss=StallOnce(at, str(tmp_path / "stalled"))),
              RunConfig(steps=STEPS, replicas=3, run_dir=run, ledger=True), hang=FAST_HANG)
    with job:
        state = drive(job, STEPS)
    assert_same_state(ref, state)
    assert_exactly_once(run, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run)
    faults = of(evs, "fault")
    assert [f["kind"] for f in faults] == ["worker_hung"]
    # Dated from the stuck worker's own record (its work stopped a deadline before it was
    # found), not from when it was found.
    assert of(evs, "detected")[0]["detect_s"] >= 0.9


def test_work_that_hangs_every_worker_stops_the_job_after_one_eviction(tmp_path):
    at = pick_sample(2, 10)
    run = tmp_path / "run"
    job = Job(spec_with(loss=StallOnce(at, str(tmp_path / "stalled"), every_time=True)),
              RunConfig(steps=STEPS, replicas=3, run_dir=run), hang=FAST_HANG,
              checkpoint=CheckpointConfig(every=1))
    with pytest.raises(planaria.WorkFault) as err, job:
        drive(job, STEPS)
    assert "micro-batch" in str(err.value)
    evs = events(run)
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_hung", "work_fault"]
    assert [e["blame"] for e in of(evs, "attribution")] == ["worker", "work"]
    # What was trained is saved: the newest committed checkpoint holds the last step (the
    # interval's, or the one the work fault took).
    assert of(evs, "checkpoint_saved")[-1]["step"] == of(evs, "run_end")[0]["step"]
