"""A preemption notice to every replica at once (a spot-reclaim wave) does not lose the run.

Every member gets SIGTERM, then SIGKILL a grace period later. The state is saved at once,
beside the steps in flight (whatever the step length: the snapshot starts within a second
of the notices), the replicas leave once their shards are written, and replacements
restore that save: no step trained is lost, the final weights equal a fault-free run's and
every sample is used once. A grace period shorter than the save is said in the event log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

import planaria
from planaria import Job, RunConfig
from planaria.checkpoint.config import CheckpointConfig
from tests.assertions import assert_exactly_once, assert_same_state, events, of
from tests.assertions import drive as drive_steps
from tests.checkpoint.test_durable_saves import G, N, drive, gated_options, register_gated, spec
from tests.loop_faults import install

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS = 8


class NoticeEveryone:
    """At ``step``, once its samples are loaded, this worker sends SIGTERM to every member
    (``pids``) and writes ``marker``: the wave lands in the middle of a step."""

    def __init__(self, step: int, pids: list[int], marker: str) -> None:
        self.step, self.pids, self.marker = step, pids, marker

    def __call__(self, worker, step: int, phase: str) -> None:
        if phase == "loaded" and step == self.step and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(time.time()))
            for pid in self.pids:
                os.kill(pid, signal.SIGTERM)


def kill_after_grace(marker: Path, pids: list[int], grace_s: float) -> threading.Thread:
    """The reclaim's second half: SIGKILL to every member ``grace_s`` after the notices."""

    def run() -> None:
        while not marker.exists():
            time.sleep(0.005)
        time.sleep(grace_s)  # the grace period itself, not a synchronisation
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread




@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with Job(spec(), RunConfig(steps=STEPS, replicas=3,
                               run_dir=tmp_path_factory.mktemp("ref"))) as job:
        return drive(job, STEPS)


@pytest.mark.parametrize(("sharded", "micro_s"), [
    (False, 1.0), pytest.param(True, 0.7, marks=pytest.mark.extended), (False, 0.03),
],
                         ids=["replicas", "sharded-replicas", "short-steps"])
def test_a_reclaim_wave_inside_a_step_is_saved_and_restored(tmp_path, reference, sharded,
                                                            micro_s):
    # Steps of ~2 s (two 1 s micro-batches per rank); the notices land inside step 3. A
    # sharded job (2 replicas of 2 workers) gets them on every worker, as a node reclaim does.
    # With short steps the autonomous run goes on past the notices until the leaving flag
    # rides a step's reduction: the steps it applied are committed and in the ledger.
    replicas, k = (2, 2) if sharded else (3, 1)
    job = Job(spec(micro_s=micro_s),
              RunConfig(steps=STEPS, replicas=replicas, workers_per_replica=k,
                        run_dir=tmp_path, ledger=True),
              checkpoint=CheckpointConfig(every=100, fsync=False))
    marker = tmp_path / "noticed"
    with job:
        pids = [p for h in job.members for p in (h.pid, *h.follower_pids)]
        install(job, "w0", NoticeEveryone(3, pids, str(marker)))
        kill_after_grace(marker, pids, grace_s=2.0)
        state = drive(job, STEPS)
    assert_same_state(reference, state)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    noticed_t = float(marker.read_text())
    started = next(e for e in of(evs, "checkpoint_started") if e["reason"] == "preemption")
    # The snapshot starts within a second of the notices. With 2 s steps only a save beside
    # the step in flight can; with short ones the step boundary may come first, and a save
    # there is as good (either way the step in hand is what is saved, nothing is lost).
    assert started["t"] - noticed_t < 1.0
    if micro_s >= 0.5:
        assert started["beside"]  # not at the step's end
    saved = next(e for e in of(evs, "checkpoint_saved") if e["reason"] == "preemption")
    assert saved["step"] == started["step"] and saved["t"] - noticed_t < 2.0
    restore = of(evs, "restore")[0]
    assert restore["step"] == saved["step"] and restore["lost_steps"] == 0
    assert not of(evs, "preemption_save_lost")


def test_a_reclaim_wave_at_a_step_boundary_is_saved_and_restored(tmp_path, reference):
    chaos = "preempt:w0@step4,preempt:w1@step4,preempt:w2@step4"
    job = Job(spec(), RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True),
              checkpoint=CheckpointConfig(every=100, fsync=False),
              chaos=planaria.ChaosPlan.parse(chaos))
    with job:  # one step at a time (train_step): the wave lands in a run of one step
        drive_steps(job, STEPS)
        state = job.model_state_dict()
    assert_same_state(reference, state)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    saved = next(e for e in of(evs, "checkpoint_saved") if e["reason"] == "preemption")
    restore = of(evs, "restore")[0]
    assert restore["step"] == saved["step"] and restore["lost_steps"] == 0
    assert {e["worker"] for e in of(evs, "drained")} == {"w0", "w1", "w2"}


def test_a_grace_shorter_than_the_save_is_said_and_the_older_save_restored(tmp_path,
                                                                           reference):
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "open").write_text("1")
    register_gated()
    root = f"gated://{tmp_path / 'ckpt'}"
    job = Job(spec(micro_s=0.3, gated=True),
              RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path / "run", ledger=True),
              checkpoint=CheckpointConfig(every=2, fsync=False, root=root,
                                          storage_options=gated_options(tmp_path, gate)))
    marker = tmp_path / "noticed"
    with job:
        drive(job, 3)  # the save of step 2 is committed
        (gate / "open").unlink()  # from now on a shard write waits at the gate ...
        pids = [h.pid for h in job.members]
        install(job, "w0", NoticeEveryone(3, pids, str(marker)))
        killer = kill_after_grace(marker, pids, grace_s=0.8)  # ... past the grace period
        threading.Thread(target=lambda: (killer.join(), (gate / "open").write_text("1")),
                         daemon=True).start()
        state = drive(job, STEPS)
    assert_same_state(reference, state)
    evs = events(tmp_path / "run")
    lost = of(evs, "preemption_save_lost")
    assert lost and "grace period" in lost[0]["reason"]
    restore = next(e for e in of(evs, "restore") if e["step"] is not None)
    assert restore["step"] == 2 and restore["lost_steps"] == 1
