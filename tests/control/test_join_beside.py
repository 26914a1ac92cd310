"""A joiner's state sent beside its first step (``RunConfig.state_beside_step``).

The survivors stall for the model's tensors only; the optimizer's arrive while every rank
computes the step, and the joiner waits for them before the reduction. Each test asserts
that the final state equals a fault-free run's and that every sample was used once: with
module buffers that a forward changes (the source must send them as they were), with the
source or the joiner killed between the model's part and the rest, and with a state too
big for the links (the whole state before the step, as without the option); the joiner reads
the state out of its source's memory on one node (``RunConfig.state_by_memory``), or over
the group without it. The
replacement's setup runs at a lower CPU priority (``RunConfig.joiner_setup_priority``), and
a dead joiner's memory goes to its replacement (``RunConfig.joiner_memory_reserve``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest
import ray

import planaria
from planaria import Job, RunConfig, fit
from planaria.examples import bn_mlp, mlp
from planaria.faults import points
from planaria.worker import forkserver
from tests.assertions import (
    assert_exactly_once,
    assert_same_state,
    drive,
    events,
    joiners_only,
    of,
    transfer_to,
)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

N, G, STEPS = 512, 64, 14
SPECS = {"mlp": lambda: mlp.make_spec(n=N), "bn_mlp": lambda: bn_mlp.make_spec(n=N)}


@pytest.fixture(scope="module")
def references(tmp_path_factory, ray_cluster):
    return {name: fit(make(), steps=STEPS, replicas=2,
                      run_dir=tmp_path_factory.mktemp(f"ref-{name}")).state_dict
            for name, make in SPECS.items()}


def step_began(worker, step, **_context) -> None:
    with worker.test_loaded:
        worker.test_loaded_step = max(worker.test_loaded_step, step)
        worker.test_loaded.notify_all()


def kill_self_in_the_step(worker, step, **_context) -> None:
    """On the transfer's thread: once this worker has begun loading the step after the
    transfer's (``step``: the steps done; it runs only after the call that started the
    transfer returned), it dies with the rest of the state unsent."""
    with worker.test_loaded:
        worker.test_loaded.wait_for(lambda: worker.test_loaded_step >= step, 60)
    os.kill(os.getpid(), signal.SIGKILL)


def arm_death_beside(actor, point: str) -> None:
    """``actor`` dies at ``point`` (the transfer's thread) once its next step began."""
    def prepare(self) -> None:
        self.test_loaded, self.test_loaded_step = threading.Condition(), -1

    ray.get(actor.__ray_call__.remote(prepare))
    ray.get(actor.arm_fault.remote("worker.loaded", step_began, times=None))
    ray.get(actor.arm_fault.remote(point, kill_self_in_the_step, times=1))


def train(run_dir, spec_name: str, *, chaos: str, before=None, widths_at=(STEPS - 3,),
          before_width=None, **config) -> dict:
    """The training; at each of ``widths_at`` steps done it waits (bounded) for full width
    (after ``before_width(job)``, when given)."""
    job = Job(SPECS[spec_name](),
              RunConfig(steps=STEPS, replicas=3, run_dir=run_dir, ledger=True, **config),
              chaos=planaria.ChaosPlan.parse(chaos))

    def wait_for_width(job) -> None:
        if job.steps_done in widths_at:
            if before_width is not None:
                before_width(job)
            job.wait_for_width(3, timeout_s=180)

    with job:
        if before is not None:
            before(job)
        drive(job, STEPS, before=wait_for_width)
        return job.model_state_dict()


def ray_worker_priority() -> str:
    """The CPU priority Ray gives a worker process (a task's thread)."""
    from planaria.worker.low_priority import thread_priority

    return ray.get(ray.remote(thread_priority).remote())


def check(run_dir, references, spec_name: str, state: dict) -> list[dict]:
    assert_same_state(references[spec_name], state)
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=STEPS)
    return events(run_dir)


@pytest.mark.parametrize("spec_name", ["mlp", "bn_mlp"])
def test_a_join_beside_the_step_computes_the_fault_free_training(tmp_path, references,
                                                                 spec_name):
    state = train(tmp_path, spec_name, chaos="kill:w1@step4")
    evs = check(tmp_path, references, spec_name, state)
    assert transfer_to(evs, "w3")["beside"] is True
    received = joiners_only(of(evs, "state_received"), evs)
    assert [(e["worker"], e["ok"]) for e in received] == [("w3", True)]
    # One node: w3 read both parts out of the source's memory (RunConfig.state_by_memory).
    assert received[0]["routes"] == ["memory", "memory"]
    assert [f["worker"] for f in of(evs, "fault")] == ["w1"]
    # The replacement's setup ran under SCHED_IDLE (RunConfig.joiner_setup_priority), the
    # first members' at the workers' own (Ray's: nice 15 by its default).
    priority = {e["worker"]: e["priority"] for e in of(evs, "worker_started")}
    assert priority["w3"] == "idle"
    assert priority["w0"] == priority["w1"] == priority["w2"] == ray_worker_priority()
    # Its process's start too, where it may set its threads back (planaria.worker.forkserver).
    lowered = "idle" if forkserver.may_raise_priority() else "worker"
    assert {e["worker"]: e["start_priority"] for e in of(evs, "worker_started")} == {
        "w0": "worker", "w1": "worker", "w2": "worker", "w3": lowered}
    # Its session's scheduling group at nice 19 through start and setup, where the kernel
    # groups sessions: else SCHED_IDLE weighs only within its own process.
    group = "nice 19" if os.path.exists(forkserver.AUTOGROUP) else "worker"
    assert {e["worker"]: e["start_group"] for e in of(evs, "worker_started")} == {
        "w0": "worker", "w1": "worker", "w2": "worker", "w3": group}
    # Its warm-up on its steps' thread, lowered and put back after where it may be.
    assert {e["worker"]: e["warm_priority"] for e in of(evs, "worker_started")} == {
        "w0": "worker", "w1": "worker", "w2": "worker", "w3": "idle" if lowered == "idle"
        else "worker"}


def test_a_join_over_the_group_computes_the_fault_free_training(tmp_path, references):
    """``state_by_memory=False``: both parts over the group, the same training."""
    state = train(tmp_path, "bn_mlp", chaos="kill:w1@step4", state_by_memory=False)
    evs = check(tmp_path, references, "bn_mlp", state)
    assert [(e["worker"], e["routes"]) for e in joiners_only(of(evs, "state_received"), evs)
            ] == [("w3", ["group", "group"])]


def test_a_dead_joiners_memory_goes_to_its_replacement(tmp_path, references):
    """Every worker's optimizer state lives in a region of shared memory
    (RunConfig.joiner_memory_reserve): w3 replaces w1 in w1's region, pages and all; w3
    dies and w4 gets w3's; the job's end removes them."""
    others = set(Path("/dev/shm").glob("planaria-reserve-*"))  # another job's, left
    state = train(tmp_path, "mlp", chaos="kill:w1@step3,kill:w3@step8",
                  widths_at=(5, STEPS - 3))
    evs = check(tmp_path, references, "mlp", state)
    assert [f["worker"] for f in of(evs, "fault")] == ["w1", "w3"]
    assert {e["worker"]: e["reserve"] for e in of(evs, "worker_started")} == {
        "w0": "new", "w1": "new", "w2": "new", "w3": "recycled", "w4": "recycled"}
    assert not set(Path("/dev/shm").glob("planaria-reserve-*")) - others


def test_the_source_killed_before_the_rest_is_sent(tmp_path, references):
    """w0 sends w3 the model's tensors and dies: w3's step fails, it holds no state, and
    w2 (the one holder left) sends it the whole state again. w0 is armed as w3 is admitted:
    armed from the start, it would die sending to a survivor that was behind at w1's death
    (caught up from w0 beside the step, as a joiner is), as the kill lands."""
    armed: list[str] = []

    def arm_the_source(*, recovery, ready) -> None:
        source = next(h for h in recovery.membership.members if h.name == "w0")
        armed.append(source.name)
        arm_death_beside(source.actor, "worker.state_sending")

    with points.armed("recovery.admit", arm_the_source, times=1):
        state = train(tmp_path, "mlp", chaos="kill:w1@step3", widths_at=(3, STEPS - 3))
    assert armed == ["w0"]
    evs = check(tmp_path, references, "mlp", state)
    assert [f["worker"] for f in of(evs, "fault")][:2] == ["w1", "w0"]
    received = joiners_only(of(evs, "state_received"), evs)
    assert (received[0]["worker"], received[0]["ok"]) == ("w3", False)
    transfers = joiners_only(of(evs, "state_transfer"), evs, key="dst")
    assert transfers[0]["src"] == "w0"
    assert transfers[1]["src"] == "w2" and "w3" in transfers[1]["dst"]  # sent again


def test_the_joiner_killed_before_the_rest_arrives(tmp_path, references):
    """w3 has the model's tensors and dies before the rest: the survivors' step fails on
    it (its receipt failed: it held no state), they keep theirs, and its own replacement
    joins later."""
    armed: list[str] = []

    def arm_the_joiner(*, recovery, ready) -> None:
        for handle in ready:
            armed.append(handle.name)
            arm_death_beside(handle.actor, "worker.state_receiving")

    with points.armed("recovery.admit", arm_the_joiner, times=1):
        state = train(tmp_path, "mlp", chaos="kill:w1@step3",
                      widths_at=(3, STEPS - 3, STEPS - 2))  # w3 joins, then w4
    assert armed == ["w3"]
    evs = check(tmp_path, references, "mlp", state)
    assert [f["worker"] for f in of(evs, "fault")][:2] == ["w1", "w3"]
    assert not of(evs, "restore"), "the survivors kept the state"
    assert [(e["worker"], e["ok"]) for e in joiners_only(of(evs, "state_received"), evs)] == [
        ("w3", False), ("w4", True)]
    assert [e["dst"] for e in joiners_only(of(evs, "state_transfer"), evs, key="dst")] == [
        ["w3"], ["w4"]]


def test_the_last_holder_stays_until_the_joiners_hold_the_state(tmp_path, references):
    """Every member preempted, no checkpoints: the last holder (the member whose notice is
    seen last: w0, w1 or w2, as the signals land) stays while w3 and w4 replace the other two.
    At their join it has a notice and they still receive the rest of the state from it (held
    there until its drain was put off): it stays until they hold it, then leaves; nothing is
    restored."""
    marker = tmp_path / "holders-stayed"

    def hold_until_the_holders_stay(worker, step, **_context) -> None:
        for _ in range(600):  # bounded: without the stay, the receipt goes on (and fails)
            if marker.exists():
                return
            threading.Event().wait(0.1)

    def arm_the_joiners(*, recovery, ready) -> None:
        for handle in ready:
            ray.get(handle.actor.arm_fault.remote("worker.state_receiving",
                                                  hold_until_the_holders_stay, times=1))

    stayed: list[list[str]] = []

    def note_the_stay(*, holders) -> None:
        stayed.append(list(holders))
        marker.touch()

    def both_join_at_once(job) -> None:
        # Both replacements join in one generation: admitted one by one (in whichever order
        # their starts end), w4's join would restart the held receipt of w3.
        starting = [h.setup_ref for h in job.membership.pool.starting]
        assert len(starting) == 2, "w3 and w4 are still starting at the width's wait"
        done, _ = ray.wait(starting, num_returns=2, timeout=120)
        assert len(done) == 2, "w3 and w4 did not finish starting within 120 s"

    with points.armed("recovery.admit", arm_the_joiners, times=1), \
            points.armed("notices.holders_stay", note_the_stay):
        state = train(tmp_path, "mlp",
                      chaos="preempt:w0@step4,preempt:w1@step4,preempt:w2@step4",
                      widths_at=(STEPS - 3,), before_width=both_join_at_once)
    evs = check(tmp_path, references, "mlp", state)
    (transfer,) = of(evs, "state_transfer")
    holder = transfer["src"]
    assert transfer["dst"] == ["w3", "w4"] and stayed and stayed[0] == [holder]
    # It left last: after the joiners held the state.
    assert [e["worker"] for e in of(evs, "drained")][-1] == holder
    assert not of(evs, "restore"), "the state never left the job"
    assert [(e["worker"], e["ok"]) for e in of(evs, "state_received")] == [
        ("w3", True), ("w4", True)]
    assert {e["worker"] for e in of(evs, "drained")} == {"w0", "w1", "w2"}


def test_a_state_too_big_for_the_links_goes_before_the_step(tmp_path, references):
    """At 1 byte/s (``min_transfer_bytes_per_s``) the rest could not arrive within the
    collective timeout: the whole state goes before the step."""
    state = train(tmp_path, "mlp", chaos="kill:w1@step4", min_transfer_bytes_per_s=1.0,
                  collective_timeout_s=60.0, joiner_setup_priority="lowest")
    evs = check(tmp_path, references, "mlp", state)
    assert [e["beside"] for e in of(evs, "state_transfer")] == [False]
    assert not of(evs, "state_received")
    assert {e["worker"]: e["priority"] for e in of(evs, "worker_started")}["w3"] == "nice 19"
