"""A controller's state rebuilt from real workers and a real run dir (planaria.control.takeover):
after a fault and its recovery, what the live workers describe and the run dir record
rebuilds the job's own membership and commit log; restored from it, under a new lease
epoch that fences off the old one, the job trains on to the fault-free weights with every
sample used once. A sharded replica describes itself as one."""

from __future__ import annotations

import sys

import pytest
import ray

import planaria
from planaria import Job, RunConfig, fit
from planaria.control.run_record import read_run_record
from planaria.control.takeover import rebuild
from planaria.examples import mlp
from planaria.faults.errors import StaleGeneration
from planaria.wire.takeover import Lease
from tests.assertions import assert_exactly_once, assert_same_state, events, of, run_to

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

N, G, BEFORE, STEPS = 512, 64, 12, 18


def describe(job: Job) -> list:
    """Every live worker's report, as a controller taking them over would ask."""
    handles = [*job.members, *job.pool.standby]
    refs = {h.name: h.actor.describe.remote() for h in handles}
    return list(job.gather(refs, deadline_s=60, step=None).values())


def test_the_state_rebuilt_from_workers_and_run_dir_is_the_jobs_and_trains_on(tmp_path):
    reference = fit(mlp.make_spec(n=N), steps=STEPS, replicas=2,
                    run_dir=tmp_path / "ref").state_dict
    run_dir = tmp_path / "job"
    job = Job(mlp.make_spec(n=N),
              RunConfig(steps=STEPS, replicas=3, run_dir=run_dir, ledger=True),
              chaos=planaria.ChaosPlan.parse("kill:w1@step4"))
    with job:
        run_to(job, 8)
        job.wait_for_width(3, timeout_s=180)  # the replacement joins at the next boundary
        run_to(job, BEFORE)
        got = rebuild(describe(job), read_run_record(run_dir))
        membership, commit_log = job.membership, job.commit_log
        assert got.run_id == job.run_id
        assert got.members == tuple(job.names) and len(got.members) == 3
        assert got.holders == tuple(h.name for h in job.members if h.has_state)
        assert got.behind == () and got.stale == () and got.standby == ()
        assert got.steps_done == job.steps_done == BEFORE and got.unrecorded == ()
        assert got.ledger_steps == BEFORE
        assert got.last_skipped == commit_log.last_skipped
        assert got.skipped_samples == job.skipped_samples
        assert got.next_gen == job.gen + 1 and got.lease_epoch == membership.lease_epoch + 1

        # Take over: the parts' own state goes, the rebuilt state comes in.
        old_gen, members = job.gen, list(job.members)
        commit_log.restart_at(0)
        membership.set_holding(job.names, False)
        commit_log.restore_from(got)
        membership.restore_from(got, members[::-1])
        assert job.names == list(got.members) and job.steps_done == BEFORE
        job.build_generation(job.members, reason="takeover")
        assert job.gen == old_gen + 1 and membership.lease == Lease(run_id=job.run_id, epoch=2)
        first = job.members[0]
        stale = Lease(run_id=job.run_id, epoch=1)  # the controller taken over
        with pytest.raises(ray.exceptions.RayTaskError) as refused:
            ray.get(first.actor.join.remote(job.gen + 1, 0, 3, BEFORE, (5.0, 5.0), lease=stale))
        assert isinstance(refused.value.cause, StaleGeneration)
        state = run_to(job, STEPS)
    assert_same_state(reference, state)
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run_dir)
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_lost"]
    assert of(evs, "generation")[-1]["epoch"] == 2
    assert all(e["gen"] > old_gen for e in of(evs, "step_committed") if e["step"] >= BEFORE)


def test_a_sharded_replica_describes_itself_as_one(tmp_path):
    from planaria.examples import tiny_gpt

    spec = tiny_gpt.make_spec(dim=32, layers=2, global_batch_size=24)
    config = RunConfig(steps=3, replicas=2, workers_per_replica=2, run_dir=tmp_path, ledger=True)
    with Job(spec, config) as job:
        run_to(job, 3)
        reports = describe(job)
        assert [r.workers for r in reports] == [2, 2]  # the leader's and its follower's, merged
        assert all(r.steps_done == 3 and r.gen == job.gen for r in reports)
        got = rebuild(reports, read_run_record(tmp_path))
        assert got.members == tuple(job.names) and got.holders == got.members
        assert got.steps_done == 3 and got.ledger_steps == 3 and got.next_gen == job.gen + 1
