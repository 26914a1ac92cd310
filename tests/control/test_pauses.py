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
from pathlib import Path

import pytest
import ray

from planaria import HangConfig, Job, RunConfig
from planaria.wire import store_keys
from tests.assertions import assert_exactly_once, assert_same_state, events, of
from tests.checkpoint.test_durable_saves import G, N, drive, spec
from tests.loop_faults import install

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS = 30


class StopThenWait:
    """At ``step``, once its gradient is computed: this worker stops itself (SIGSTOP; the test
    lets it go) and, continued, goes on with its micro-batch for ``then_s`` more seconds
    without a sign of progress (as the rest of a micro-batch on another thread does)."""

    def __init__(self, step: int, marker: str, then_s: float) -> None:
        self.step, self.marker, self.then_s = step, marker, then_s

    def __call__(self, worker, step: int, phase: str) -> None:
        if phase == "computed" and step == self.step and not os.path.exists(self.marker):
            from planaria.wire.heartbeat import Heartbeat

            # Its last micro-batch's progress reported first (a beat is every 0.25 s): the
            # controller must see no progress from here on but the pause's.
            while Heartbeat.parse(worker.store.get(store_keys.heartbeat(worker.name))).progress \
                    != worker.vitals.progress:
                time.sleep(0.01)
            Path(self.marker).write_text(worker.name)
            os.kill(os.getpid(), signal.SIGSTOP)  # it may stop a moment after kill returns:
            while not os.path.exists(self.marker + ".continued"):  # written before SIGCONT
                time.sleep(0.01)
            time.sleep(self.then_s)  # the rest of its micro-batch, after the pause


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


@pytest.mark.parametrize("pause_s", [3.5, pytest.param(7.0, marks=pytest.mark.extended)])
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


def test_a_pause_inside_a_micro_batch_longer_than_the_step_deadline_is_not_a_hang(tmp_path):
    # Steps of ~1 s, a step deadline of 3 s; the worker stops itself in the middle of its
    # micro-batch (SIGSTOP once its gradient is computed) and is let go 6 s later: inside the
    # heartbeat timeout (10 s), past the step deadline; its micro-batch then takes 1.5 s
    # more. The time it stood still as a whole is not its work's: it is not found stuck.
    marker = tmp_path / "stopped"
    job = Job(spec(micro_s=0.5), RunConfig(steps=12, replicas=3, run_dir=tmp_path / "run",
                                           ledger=True),
              hang=HangConfig(floor_s=3.0, factor=2.0))
    with job:
        pid = next(h.pid for h in job.members if h.name == "w1")
        install(job, "w1", StopThenWait(4, str(marker), then_s=1.5))

        def let_go() -> None:
            while not marker.exists():
                time.sleep(0.01)
            time.sleep(6.0)  # the pause itself
            Path(str(marker) + ".continued").write_text("")
            os.kill(pid, signal.SIGCONT)

        thread = threading.Thread(target=let_go, daemon=True)
        thread.start()
        state = drive(job, 12)
        thread.join()
    evs = events(tmp_path / "run")
    assert not of(evs, "fault") and not of(evs, "hang_stack")
    assert {g["world_size"] for g in of(evs, "generation")} == {3}
    assert_exactly_once(tmp_path / "run", num_samples=N, global_batch_size=G, steps=12)
    with Job(spec(), RunConfig(steps=12, replicas=3, run_dir=tmp_path / "ref")) as ref:
        assert_same_state(drive(ref, 12), state)
