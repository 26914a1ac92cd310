"""A healthy process that pauses (a long GC, swap, a noisy neighbour) is not a stopped one.

A worker is frozen (SIGSTOP) for a few seconds in the middle of a run and let go again
(SIGCONT), at the default hang settings: it must stay, and the training equal a fault-free
run's. (A 3.5 s pause used to get a worker killed: the heartbeat timeout was 3 s.) A
pause it reported raises the timeout in force for the rest of the job.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import ray

from planaria import Job, RunConfig
from tests.assertions import assert_exactly_once, assert_same_state, events, of
from tests.test_durable_saves import G, N, drive, spec

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS = 30


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with Job(spec(), RunConfig(steps=STEPS, replicas=3,
                               run_dir=tmp_path_factory.mktemp("ref"))) as job:
        return drive(job, STEPS)


def pause_during(job: Job, name: str, at_step: int, pause_s: float) -> threading.Thread:
    pid = next(h.pid for h in job.members if h.name == name)
    assert pid is not None

    def run() -> None:
        while job.steps_done < at_step:  # the job's own progress: no guessed time
            time.sleep(0.01)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(pause_s)  # the pause itself
        os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("pause_s", [3.5, 7.0])
def test_a_worker_that_pauses_for_seconds_is_not_evicted(tmp_path, reference, pause_s):
    job = Job(spec(micro_s=0.02), RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path,
                                            ledger=True))
    with job:
        thread = pause_during(job, "w1", 5, pause_s)
        state = drive(job, STEPS)
        thread.join()
        learned = job.liveness.timeout_s
    assert_same_state(reference, state)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    assert not of(evs, "fault") and not of(evs, "hang_stack")
    assert {g["world_size"] for g in of(evs, "generation")} == {3}
    # The pause it reported raises the timeout in force: a like pause later is no hang.
    assert learned >= 3 * (pause_s - 0.5)
