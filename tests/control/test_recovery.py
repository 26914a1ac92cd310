"""In-process recovery with real signals to real worker processes.

Every fault test asserts the final parameters equal a fault-free run of the
same spec and seed, that the ledger shows every sample exactly once, that no
committed step was lost, and that a replacement joined.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import ray

import planaria
from planaria import (
    ElasticRuntimeError,
    HangConfig,
    Job,
    RecoveryPolicy,
    RunConfig,
    UserCodeError,
    fit,
)
from planaria.examples import mlp
from planaria.faults import points
from tests.assertions import assert_exactly_once, assert_same_state, events, of, transfer_to

# The workers unpickle this module's helpers by value: they cannot import the tests package.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

N, G, STEPS = 512, 64, 30
FAST_HANG = HangConfig(heartbeat_timeout_s=2.5, floor_s=3.0, heartbeat_s=0.1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ray_cluster):
    return fit(
        mlp.make_spec(n=N), steps=STEPS, replicas=2, run_dir=tmp_path_factory.mktemp("ref")
    ).state_dict


def run_with_faults(
    run_dir: Path, *, chaos: str, hang: HangConfig | None = None
) -> planaria.FitResult:
    """fit()'s loop, except that before the last steps it waits (bounded) for a pending
    replacement to join, so that a slow worker start on a loaded machine cannot end the
    run before it."""
    job = Job(
        mlp.make_spec(n=N),
        RunConfig(steps=STEPS, replicas=3, run_dir=run_dir, ledger=True),
        chaos=planaria.ChaosPlan.parse(chaos),
        hang=hang,
    )
    with job:
        while job.steps_done < STEPS:
            try:
                if job.steps_done == STEPS - 3:
                    job.wait_for_width(3, timeout_s=180)
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        state = job.model_state_dict()
    return planaria.FitResult(job.steps_done, job.losses, run_dir / "events.jsonl", state, run_dir)


def check_recovered(run_dir: Path, result, reference, *, faults: int, kind: str) -> list[dict]:
    assert result.final_step == STEPS
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run_dir)
    assert [f["kind"] for f in of(evs, "fault")] == [kind] * faults
    recovered = of(evs, "recovered")
    assert recovered and all(r["lost_steps"] == 0 for r in recovered)
    assert of(evs, "joined"), "the replacement never joined"
    assert of(evs, "step_committed")[-1]["width"] == 3
    return evs


def test_kill_resize_and_hot_join(tmp_path, reference):
    result = run_with_faults(tmp_path, chaos="kill:w1@step8")
    evs = check_recovered(tmp_path, result, reference, faults=1, kind="worker_lost")
    assert of(evs, "fault")[0]["worker"] == "w1"
    assert 2 in {e["width"] for e in of(evs, "step_committed")}  # went on with the survivors
    assert transfer_to(evs, "w3")["bytes"] > 0
    assert of(evs, "detected")[0]["detect_s"] < 5


@pytest.mark.extended  # hangs: test_long_steps.py and test_autonomous.py
def test_hang_is_detected_killed_and_replaced(tmp_path, reference):
    result = run_with_faults(tmp_path, chaos="hang:w0@step8", hang=FAST_HANG)
    evs = check_recovered(tmp_path, result, reference, faults=1, kind="worker_hung")
    assert of(evs, "hang_stack")[0]["worker"] == "w0"
    assert of(evs, "detected")[0]["detect_s"] < 10


def test_preempt_drains_at_step_boundary(tmp_path, reference):
    result = run_with_faults(tmp_path, chaos="preempt:w2@step8")
    evs = check_recovered(tmp_path, result, reference, faults=1, kind="preempted")
    assert not of(evs, "step_failed"), "a preemption must not fail a step"
    assert of(evs, "drained")[0]["worker"] == "w2"


def test_two_workers_killed_in_the_same_step(tmp_path, reference):
    result = run_with_faults(tmp_path, chaos="kill:w0@step8,kill:w1@step8")
    evs = check_recovered(tmp_path, result, reference, faults=1, kind="worker_lost")
    assert set(of(evs, "fault")[0]["worker"].split(",")) == {"w0", "w1"}
    assert 1 in {e["width"] for e in of(evs, "step_committed")}


@pytest.mark.extended  # deaths at a join: test_compound_faults.py
def test_fault_during_hot_join(tmp_path, reference):
    killed: list[str] = []

    def kill_the_joiner(*, membership, joiners):
        joiner = membership.members[joiners[0]]
        killed.append(joiner.name)
        os.kill(joiner.pid, signal.SIGKILL)

    with points.armed("membership.send_state", kill_the_joiner, times=1):
        result = run_with_faults(tmp_path, chaos="kill:w1@step5")
    assert killed == ["w3"]
    assert result.final_step == STEPS
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    assert [f["worker"] for f in of(evs, "fault")][:2] == ["w1", "w3"]
    assert all(r["lost_steps"] == 0 for r in of(evs, "recovered"))
    # The dead joiner's place is asked for again (whether that one is up before the run's
    # last step depends on the machine's start time, not on planaria: not asserted).
    assert [e["worker"] for e in of(evs, "replacement_requested")][:2] == ["w3", "w4"]


def test_zombie_after_sigcont_is_fenced_off(tmp_path, reference):
    spec = mlp.make_spec(n=N)
    with Job(
        spec, RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True), hang=FAST_HANG
    ) as job:
        for _ in range(5):
            job.train_step()
        zombie = job.members[1]
        os.kill(zombie.pid, signal.SIGSTOP)
        stale_gen = job.gen
        stale_call = zombie.actor.commit.remote(stale_gen, job.steps_done)  # queued while stopped
        job.evict([zombie.name], kill=False)  # evicted (fenced), but not killed: it can wake up
        job.build_generation(job.members, reason="resize")
        for _ in range(5):
            job.train_step()
        os.kill(zombie.pid, signal.SIGCONT)
        # It notices it was fenced off and exits; whatever it still runs is refused.
        with pytest.raises((planaria.PlanariaError, ray.exceptions.RayError)):
            ray.get(stale_call, timeout=30)
        deadline = time.time() + 20
        while time.time() < deadline and _alive(zombie.pid):
            time.sleep(0.1)
        assert not _alive(zombie.pid)
        while job.steps_done < STEPS:
            job.train_step()
        assert_same_state(reference, job.model_state_dict())
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie process entry is dead too
        return f.read().split()[2] != "Z"


def _bad_loss(model, batch):
    _, y = batch
    if (y > 100).any():
        raise ValueError("a poisoned sample reached the loss")
    return mlp.mse(model, batch)


class _Poisoned(mlp.Regression):
    def __init__(self) -> None:
        super().__init__(n=N)
        self.y[7] = 1000.0


def test_user_exception_stops_at_once_with_original_traceback(tmp_path):
    spec = planaria.TrainSpec(
        model=mlp.make_model,
        optimizer=lambda p: __import__("torch").optim.SGD(p, lr=0.1),
        loss=_bad_loss,
        dataset=_Poisoned,
        global_batch_size=G,
        micro_batch_size=16,
    )
    t0 = time.time()
    with pytest.raises(UserCodeError) as info:
        fit(spec, steps=STEPS, replicas=2, run_dir=tmp_path)
    assert time.time() - t0 < 60
    text = str(info.value)
    assert (
        "a poisoned sample reached the loss" in text and "_bad_loss" in text and "Traceback" in text
    )
    evs = events(tmp_path)
    assert len(of(evs, "fault")) == 1 and of(evs, "action")[0]["action"] == "abort"
    assert of(evs, "run_end")[0]["status"] == "aborted"


def test_below_min_replicas_past_pause_timeout_aborts_cleanly(tmp_path):
    policy = RecoveryPolicy(min_replicas=2, pause_timeout_s=2, replace_workers=False)
    with pytest.raises(ElasticRuntimeError, match="below min_replicas=2") as info:
        fit(
            mlp.make_spec(n=N),
            steps=STEPS,
            replicas=2,
            run_dir=tmp_path,
            policy=policy,
            chaos="kill:w0@step4",
        )
    assert isinstance(info.value.__cause__, planaria.WorkerLost)
    evs = events(tmp_path)
    assert of(evs, "run_end")[0]["status"] == "aborted"


@pytest.mark.extended
def test_elastic_retry_reinvokes_after_a_kill(tmp_path, reference):
    job = Job(
        mlp.make_spec(n=N),
        RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True),
        chaos=planaria.ChaosPlan.parse("kill:w2@step6"),
    )
    calls: list[int] = []

    @planaria.elastic_retry(job, max_retries=3)
    def train(job: Job) -> int:
        calls.append(job.steps_done)
        while job.steps_done < STEPS:
            job.train_step()
        return job.steps_done

    with job:
        assert train() == STEPS
        state = job.model_state_dict()
    assert len(calls) == 2 and calls[0] == 0 and calls[1] == 6
    assert_same_state(reference, state)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)


def _poisoned_spec() -> planaria.TrainSpec:
    return planaria.TrainSpec(
        model=mlp.make_model,
        optimizer=lambda p: __import__("torch").optim.SGD(p, lr=0.1),
        loss=_bad_loss,
        dataset=_Poisoned,
        global_batch_size=G,
        micro_batch_size=16,
    )


def test_elastic_retry_saves_what_is_safe_before_a_user_error_stops_it(tmp_path):
    """A user-code error under elastic_retry stops the job as under fit: not retried, and
    only after the committed state is saved (the interval's save in flight finished too):
    the root holds a committed checkpoint of the last committed step, which a new job
    resumes from."""
    from planaria.checkpoint import list_checkpoints, load_checkpoint
    from planaria.checkpoint.config import CheckpointConfig
    from planaria.data.plan import DataPlan

    plan = DataPlan(N, G, seed=0)
    poisoned = next(s for s in range(STEPS) if 7 in plan.batch(s).tolist())
    assert poisoned > 3, "the test needs steps committed before the poisoned one"
    root = str(tmp_path / "ckpt")
    job = Job(_poisoned_spec(), RunConfig(steps=STEPS, replicas=2, run_dir=tmp_path / "run"),
              checkpoint=CheckpointConfig(root=root, every=3))
    calls: list[int] = []
    trained: dict = {}

    @planaria.elastic_retry(job, max_retries=3)
    def train(job: Job) -> None:
        calls.append(job.steps_done)
        while job.steps_done < STEPS:
            if job.steps_done == poisoned:
                trained.update(job.state()[0])  # the committed state the error must not lose
            job.train_step()

    with pytest.raises(UserCodeError, match="a poisoned sample reached the loss"), job:
        train()
    assert calls == [0]  # never retried
    committed = [c.step for c in list_checkpoints(root) if c.committed]
    assert committed[-1] == poisoned
    saved, _ = load_checkpoint(f"{root}/step_{poisoned:09d}")
    for name, tensor in trained.items():
        assert __import__("torch").equal(saved[name], tensor), name
    evs = events(tmp_path / "run")
    assert [e["reason"] for e in of(evs, "checkpoint_saved")][-1] == "user_code_error"


def test_elastic_retry_saves_before_the_function_s_own_error(tmp_path):
    """An exception raised by the wrapped function itself (between the job's calls) is the
    user's code too: saved first, then raised as it is."""
    from planaria.checkpoint import list_checkpoints
    from planaria.checkpoint.config import CheckpointConfig

    root = str(tmp_path / "ckpt")
    job = Job(mlp.make_spec(n=N), RunConfig(steps=STEPS, replicas=2, run_dir=tmp_path / "run"),
              checkpoint=CheckpointConfig(root=root, every=100))

    @planaria.elastic_retry(job)
    def train(job: Job) -> None:
        while job.steps_done < 5:
            job.train_step()
        raise KeyError("a bug in the loop")

    with pytest.raises(KeyError, match="a bug in the loop"), job:
        train()
    assert [c.step for c in list_checkpoints(root) if c.committed] == [5]
