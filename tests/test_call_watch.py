"""CallWatch: the calls that ended, from completion callbacks, at O(1) a wait."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from planaria.call_watch import CallWatch

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
