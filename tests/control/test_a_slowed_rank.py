"""Where each rank's step time went reaches the report: a rank slowed on purpose (its steps'
samples take longer to load, on that worker only) is named the slowest, in load, by a
clear margin, and the others' time goes to waiting for it in the reduction. Real
workers, three replicas."""

from __future__ import annotations

import sys
import time

import pytest
import ray

from planaria import Job, RunConfig
from planaria.observe.metrics import summarize
from planaria.observe.report import plot_timeline
from tests.checkpoint.test_durable_saves import spec
from tests.loop_faults import arm

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS, SLOW_S = 10, 0.1


class SlowLoad:
    """A step's samples loaded, on the worker it is armed at: it takes ``seconds`` more (as a
    slow disk or a busy decoder on one node would)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, *, worker: object, step: int) -> None:
        time.sleep(self.seconds)  # the slowness itself, not a wait for anything


def test_the_rank_slowed_on_purpose_is_named_slowest_and_the_others_wait_for_it(tmp_path):
    run = tmp_path / "run"
    with Job(spec(), RunConfig(steps=STEPS, replicas=3, run_dir=run)) as job:
        arm(job, "w1", "worker.loaded", SlowLoad(SLOW_S))
        while job.steps_done < STEPS:
            job.run_steps(STEPS)
    summary = summarize(run)
    ranks = summary.to_json()["ranks"]  # what `planaria report --json` prints
    assert ranks is not None and ranks["width"] == 3
    assert ranks["slowest_worker"] == "w1" and ranks["slowest_part"] == "load"
    by_worker = {r["worker"]: r for r in ranks["ranks"]}
    slow, others = by_worker["w1"], [r for w, r in by_worker.items() if w != "w1"]
    assert slow["steps"] == STEPS and all(r["steps"] == STEPS for r in others)
    assert slow["load"] >= 0.8 * SLOW_S
    for other in others:
        assert slow["load"] - other["load"] >= 0.5 * SLOW_S, ranks  # a clear margin
        assert other["reduce_wait"] >= 0.5 * SLOW_S, ranks  # they wait for it
        assert other["reduce_wait"] - slow["reduce_wait"] >= 0.3 * SLOW_S, ranks
    # The picture's per-rank panel is drawn from the same figures.
    assert summary.ranks is not None
    assert [m.worker for m in summary.ranks.ranks] == [r["worker"] for r in ranks["ranks"]]
    png = plot_timeline(list(_events(run)), summary, tmp_path / "timeline.png")
    assert png.stat().st_size > 0


def _events(run):
    from planaria.observe.events import read_events

    return read_events(run).events
