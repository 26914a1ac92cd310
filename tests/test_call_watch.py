"""CallWatch: the calls that ended, from completion callbacks, at O(1) a wait."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

import planaria.control.calls
from planaria import HangConfig, fit
from planaria.call_watch import CallWatch
from planaria.examples import bn_mlp
from tests.assertions import assert_exactly_once, assert_same_state, events, of

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@ray.remote(num_cpus=0)
class _Sleeper:
    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_calls_end_in_the_order_they_end_and_a_death_is_known_at_once(ray_cluster):
    actors = [_Sleeper.remote() for _ in range(4)]  # type: ignore[attr-defined]
    pids = ray.get([a.pid.remote() for a in actors])
    refs = [a.sleep.remote(s) for a, s in zip(actors, (30, 0.2, 30, 30), strict=True)]
    watch = CallWatch(refs)
    assert watch.wait(0.01) == [] and len(watch) == 4  # nothing ended yet
    assert watch.wait(10) == [refs[1]] and ray.get(refs[1]) == 0.2
    assert watch.pending == [refs[0], refs[2], refs[3]]

    os.kill(pids[2], signal.SIGKILL)  # the others run on for half a minute
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


def test_a_call_whose_callback_never_came_is_found_by_asking_and_each_call_ends_once(
    ray_cluster,
):
    actors = [_Sleeper.remote() for _ in range(3)]  # type: ignore[attr-defined]
    refs = [a.sleep.remote(s) for a, s in zip(actors, (0.1, 30, 30), strict=True)]
    watch = CallWatch(refs)
    ray.get(refs[0])
    time.sleep(0.2)  # its callback came and is queued: lose it, as if it had never come
    while watch._ended.qsize():
        watch._ended.get_nowait()
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


class _Deaf(CallWatch):
    """A watch whose completion callbacks never come (the notices Ray sends are lost)."""

    def __init__(self, refs) -> None:
        super().__init__(refs)
        self._ended = _Lost()


class _Lost:
    def put(self, item) -> None:
        pass

    def get(self, timeout: float):
        time.sleep(timeout)
        raise __import__("queue").Empty

    def get_nowait(self):
        raise __import__("queue").Empty


@pytest.mark.extended
def test_a_job_whose_call_notices_never_come_still_trains_and_recovers(
    ray_cluster, tmp_path, monkeypatch, caplog
):
    """Every call's end is found by asking Ray (CallWatch.recheck); a killed worker's and a
    hung one's too: the final state is a fault-free run's, every sample used once. A long
    wait says whom it waits for."""
    n, g, steps = 256, 64, 12
    spec = bn_mlp.make_spec(n=n)
    reference = fit(spec, steps=steps, replicas=1, run_dir=tmp_path / "ref").state_dict
    monkeypatch.setattr(planaria.control.calls, "CallWatch", _Deaf)
    monkeypatch.setattr(planaria.control.calls, "RECHECK_S", 0.3)
    monkeypatch.setattr(planaria.control.calls, "WAIT_REPORT_S", 1.0)
    run_dir = tmp_path / "run"
    result = fit(spec, steps=steps, replicas=3, run_dir=run_dir, ledger=True,
                 chaos="kill:w1@step3,hang:w0@step8",
                 hang=HangConfig(floor_s=1.0))  # the hang's wait outlasts a step's deadline
    assert result.final_step == steps
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(run_dir, num_samples=n, global_batch_size=g, steps=steps)
    evs = events(run_dir)
    assert [e["step"] for e in of(evs, "step_committed")] == list(range(steps))
    assert {e["kind"] for e in of(evs, "fault")} == {"worker_lost", "worker_hung"}
    assert "without Ray's notice" in caplog.text  # each call's end was found by asking
    assert "waited" in caplog.text and "silent" in caplog.text  # the hang's wait, reported
