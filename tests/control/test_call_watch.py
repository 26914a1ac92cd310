"""CallWatch: the calls that ended, from completion callbacks, at O(1) a wait."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import ray

from planaria import HangConfig, fit
from planaria.control.call_watch import CallWatch
from planaria.examples import bn_mlp
from planaria.faults import points
from tests.assertions import assert_exactly_once, assert_same_state, events, of

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@ray.remote(num_cpus=0)
class _Sleeper:
    def pid(self) -> int:
        return os.getpid()

    def wait_for(self, path: str, limit_s: float = 300.0) -> bool:
        """Returns once ``path`` exists (True), or after ``limit_s`` (False)."""
        end = time.monotonic() + limit_s
        while not os.path.exists(path):
            if time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    def hold(self, address: str, name: str) -> bool:
        """Connects this process's lifeline to the controller's listener at ``address``."""
        from planaria.wire.lifeline import hold

        return hold(address, name) is not None


@ray.remote(num_cpus=0)
class _Answerer:
    def big(self, size: int) -> Any:
        from tests.control.counted_result import Counted

        return Counted(size)

    def die(self) -> None:
        os._exit(1)


def test_a_result_is_deserialized_once_and_an_error_raised_as_ray_get_would(ray_cluster):
    """The callback's future holds the result Ray deserialized for it: result() takes it
    from there (a whole state returned by Job.state() is not unpickled twice)."""
    from tests.control.counted_result import UNPICKLED

    actor = _Answerer.remote()  # type: ignore[attr-defined]
    UNPICKLED.clear()
    ref = actor.big.remote(64 << 20)
    watch = CallWatch([ref])
    assert watch.wait(60) == [ref]
    assert len(watch.result(ref)) == 64 << 20
    assert UNPICKLED == [64 << 20]
    dead = actor.die.remote()
    watch = CallWatch([dead])
    assert watch.wait(60) == [dead]
    with pytest.raises(ray.exceptions.RayActorError):
        watch.result(dead)


def test_a_call_the_recheck_finds_while_its_callback_deserializes_is_deserialized_once(
        ray_cluster):
    """Ray says the call has ended (the recheck) while its callback thread is still
    unpickling the result: result() waits for that one instead of unpickling it again
    beside it (a 907 MB Job.state() held twice, and took twice as long)."""
    from tests.control import counted_result as cr

    actor = _Answerer.remote()  # type: ignore[attr-defined]
    cr.UNPICKLED.clear()
    cr.STARTED.clear()
    cr.RELEASE.clear()
    try:
        ref = actor.big.remote(1 << 20)
        watch = CallWatch([ref])
        assert cr.STARTED.wait(60)  # the callback's unpickling has begun, and waits
        end, found = time.monotonic() + 60, []
        while not found and time.monotonic() < end:
            found = watch.recheck()  # Ray's own answer: the object is here
        assert found == [ref]
        got: list[Any] = []
        taker = threading.Thread(target=lambda: got.append(watch.result(ref)))
        taker.start()
        cr.RELEASE.set()
        taker.join(60)
        assert len(got[0]) == 1 << 20
        assert cr.UNPICKLED == [1 << 20]  # once: the callback's
    finally:
        cr.RELEASE.set()


def test_calls_end_in_the_order_they_end_and_a_death_is_known_at_once(ray_cluster, tmp_path):
    actors = [_Sleeper.remote() for _ in range(4)]  # type: ignore[attr-defined]
    pids = ray.get([a.pid.remote() for a in actors])
    gate, never = tmp_path / "open", str(tmp_path / "never")
    refs = [a.wait_for.remote(str(gate) if i == 1 else never) for i, a in enumerate(actors)]
    watch = CallWatch(refs)
    assert watch.wait(0.01) == [] and len(watch) == 4  # nothing ended yet: the gate is shut
    gate.write_text("")
    assert watch.wait(30) == [refs[1]] and ray.get(refs[1]) is True
    assert watch.pending == [refs[0], refs[2], refs[3]]

    os.kill(pids[2], signal.SIGKILL)  # the others wait on until they are killed
    t0 = time.monotonic()
    ended = watch.wait(10)
    assert ended == [refs[2]] and time.monotonic() - t0 < 5
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(ended[0])
    assert watch.pending == [refs[0], refs[3]]
    for pid in (pids[0], pids[3]):
        os.kill(pid, signal.SIGKILL)
    seen: list = []
    while len(watch):
        seen += watch.wait(10)
    assert sorted(map(str, seen)) == sorted(map(str, [refs[0], refs[3]]))


def _ray_never_tells(*, ref, future):
    """At ``calls.notice``: every notice is dropped."""
    return points.SKIP


def _ray_never_tells_of_deaths(*, ref, future):
    """At ``calls.notice``: the notice of a call whose worker died is dropped."""
    return points.SKIP if isinstance(future.exception(), ray.exceptions.RayActorError) else None


class _Heard:
    def __init__(self) -> None:
        self.names: list[str] = []
        self.came = threading.Event()

    def process_ended(self, name: str) -> None:
        self.names.append(name)
        self.came.set()


def test_a_call_ends_when_its_worker_process_does_though_ray_never_tells(ray_cluster,
                                                                          tmp_path):
    """With the workers' lifelines (exits), a SIGKILLed worker's call ends as a death
    (WorkerExited) with every Ray notice lost; a call whose result had come before its
    worker died gives that result."""
    from planaria.faults.errors import WorkerExited, is_death
    from planaria.wire.lifeline import Lifelines

    lifelines = Lifelines("127.0.0.1")
    try:
        actors = [_Sleeper.remote() for _ in range(2)]  # type: ignore[attr-defined]
        assert ray.get([a.hold.remote(lifelines.address, f"w{i}")
                        for i, a in enumerate(actors)]) == [True, True]
        pids = ray.get([a.pid.remote() for a in actors])
        never = str(tmp_path / "never")
        with points.armed("calls.notice", _ray_never_tells):
            refs = {actors[0].wait_for.remote(never): "w0"}
            watch = CallWatch(refs, exits=lifelines)
            assert watch.wait(0.05) == []
            os.kill(pids[0], signal.SIGKILL)
            ended = watch.wait(30)
            assert ended == list(refs)
            with pytest.raises(WorkerExited) as err:
                watch.result(ended[0])
            assert is_death(err.value) and "w0" in str(err.value)
            watch.close()

        answered = actors[1].pid.remote()
        assert ray.get(answered) == pids[1]  # its result is here before the process ends
        heard = _Heard()
        lifelines.watch(heard, [])
        os.kill(pids[1], signal.SIGKILL)
        assert heard.came.wait(30) and heard.names == ["w1"]
        watch = CallWatch({answered: "w1"}, exits=lifelines)
        assert watch.wait(30) == [answered]  # once, though both the exit and Ray told
        assert watch.result(answered) == pids[1]
        assert watch.wait(0.05) == []
        watch.close()
    finally:
        lifelines.close()


@pytest.mark.extended
def test_a_killed_worker_is_found_from_its_lifeline_when_ray_never_tells_of_its_death(
    ray_cluster, tmp_path
):
    """Ray's notice of the killed worker's calls never comes, and Ray is not asked for an
    hour (recheck_s): its death is known from its lifeline, and the job recovers as from
    any death: the final state is a fault-free run's, every sample used once."""
    n, g, steps = 256, 64, 8
    spec = bn_mlp.make_spec(n=n)
    reference = fit(spec, steps=steps, replicas=1, run_dir=tmp_path / "ref").state_dict
    run_dir = tmp_path / "run"
    with points.armed("calls.notice", _ray_never_tells_of_deaths):
        result = fit(spec, steps=steps, replicas=3, run_dir=run_dir, ledger=True,
                     chaos="kill:w1@step3", hang=HangConfig(recheck_s=3600.0))
    assert result.final_step == steps
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(run_dir, num_samples=n, global_batch_size=g, steps=steps)
    evs = events(run_dir)
    assert [e["kind"] for e in of(evs, "fault")] == ["worker_lost"]
    assert [(e["worker"], e["via"]) for e in of(evs, "failure_seen")] == [("w1", "lifeline")]


class _LosesOne:
    """At the fault point ``calls.notice``: Ray's completion notice of ``lost`` is dropped as
    it comes (as if it had never come); ``came`` is set then."""

    def __init__(self, lost) -> None:
        self.lost = lost
        self.came = threading.Event()

    def __call__(self, *, ref, future):
        if ref == self.lost:
            self.came.set()
            return points.SKIP
        return None


def test_a_call_whose_callback_never_came_is_found_by_asking_and_each_call_ends_once(
    ray_cluster, tmp_path
):
    actors = [_Sleeper.remote() for _ in range(3)]  # type: ignore[attr-defined]
    refs = [actors[0].pid.remote()]
    refs += [a.wait_for.remote(str(tmp_path / "never")) for a in actors[1:]]
    notices = _LosesOne(refs[0])
    with points.armed("calls.notice", notices):
        watch = CallWatch(refs)
        ray.get(refs[0])
        assert notices.came.wait(30)  # its callback came, and was lost
        assert watch.wait(0.3) == [] and len(watch) == 3
        assert watch.recheck() == [refs[0]] and watch.pending == refs[1:]
        assert watch.recheck() == []  # taken once

        watch.drop([refs[2]])  # its worker was killed by the caller: not waited for
        assert watch.pending == [refs[1]]
        ray.kill(actors[2])
        ray.kill(actors[1])
        seen: list = []
        deadline = time.monotonic() + 20
        while len(watch) and time.monotonic() < deadline:
            seen += watch.wait(1)
        assert seen == [refs[1]]  # the dropped call's end is not reported
        assert watch.wait(0.5) == []


@pytest.mark.extended
def test_a_job_whose_call_notices_never_come_still_trains_and_recovers(
    ray_cluster, tmp_path, caplog
):
    """Every call's end is found by asking Ray (CallWatch.recheck); a killed worker's and a
    hung one's too: the final state is a fault-free run's, every sample used once. A long
    wait says whom it waits for.

    The wait is reported once it outlasts the step deadline; the hang (SIGSTOP) is found
    when the heartbeat timeout passes. The order is not left to the machine's speed: the
    heartbeat timeout is too long to pass during the test until a wait on w0 was reported
    after its hang was sent, and is lowered then."""
    n, g, steps = 256, 64, 12
    spec = bn_mlp.make_spec(n=n)
    reference = fit(spec, steps=steps, replicas=1, run_dir=tmp_path / "ref").state_dict
    run_dir = tmp_path / "run"
    reported: list[list[str]] = []

    def hang_found_once_reported(*, names, step, waited_s, liveness):
        if "w0" in names and any(e["action"] == "hang" for e in of(events(run_dir), "chaos")):
            reported.append(list(names))
            liveness.base_timeout_s = 5.0

    with points.armed("calls.notice", _ray_never_tells), \
            points.armed("calls.wait_reported", hang_found_once_reported):
        result = fit(spec, steps=steps, replicas=3, run_dir=run_dir, ledger=True,
                     chaos="kill:w1@step3,hang:w0@step8",
                     hang=HangConfig(floor_s=1.0, heartbeat_timeout_s=3600.0, recheck_s=0.3,
                                     wait_report_s=1.0))
    assert result.final_step == steps
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(run_dir, num_samples=n, global_batch_size=g, steps=steps)
    evs = events(run_dir)
    assert [e["step"] for e in of(evs, "step_committed")] == list(range(steps))
    assert {e["kind"] for e in of(evs, "fault")} == {"worker_lost", "worker_hung"}
    assert "without Ray's notice" in caplog.text  # each call's end was found by asking
    assert reported  # the hang's wait, reported
    assert "waited" in caplog.text and "silent" in caplog.text
