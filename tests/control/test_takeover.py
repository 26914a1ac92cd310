"""A controller's state rebuilt from the live workers' reports and the run dir
(planaria.control.takeover), without Ray: every rule, with made-up reports."""

from __future__ import annotations

from dataclasses import replace

import pytest

from control_fakes import handle
from planaria.config import RunConfig
from planaria.control.commit_log import CommitLog
from planaria.control.hooks import FaultHooks
from planaria.control.membership import Membership
from planaria.control.policy import HangConfig
from planaria.control.run_record import RunRecord, read_run_record
from planaria.control.takeover import TakeoverRefused, rebuild
from planaria.control.watchdog import StepDeadline
from planaria.data.ledger import Ledger
from planaria.faults.errors import StaleGeneration
from planaria.observe.events import EventLog
from planaria.wire.takeover import Lease, WorkerReport
from planaria.worker.membership import Membership as WorkerMembership

RUN = "run-a"


def report(name: str, *, gen: int = 4, rank: int | None = 0, steps: int = 10,
           pending: int | None = None, intact: bool = True, run: str | None = RUN,
           epoch: int = 1, skip: tuple[int, ...] = ()) -> WorkerReport:
    return WorkerReport(name=name, workers=1, gen=gen, rank=rank, steps_done=steps,
                        pending=pending, intact=intact,
                        lease=Lease(run_id=run, epoch=epoch) if run is not None else None,
                        skipped_samples=skip)


def record(**fields) -> RunRecord:
    base = {"run_id": RUN, "gen": 4, "members": ("w0", "w1", "w3"), "epoch": 1,
            "steps_done": 10}
    return RunRecord(**{**base, **fields})


def trio(**fields) -> list[WorkerReport]:
    """The run dir's generation 4: w3 at rank 0, w0 at 1, w1 at 2."""
    return [report("w0", rank=1, **fields), report("w1", rank=2, **fields),
            report("w3", rank=0, **fields)]


# ---- members -------------------------------------------------------------------------------


def test_a_quiet_job_is_rebuilt_as_it_was_under_a_new_epoch_and_generation():
    spare = report("w5", gen=-1, rank=None, steps=0, run=None)
    evicted = report("w2", gen=3, rank=1, steps=7)
    got = rebuild([*trio(), spare, evicted], record())
    assert got.members == ("w3", "w0", "w1")  # rank order, not name order
    assert got.holders == got.members and got.behind == ()
    assert got.stale == ("w2",) and got.standby == ("w5",)
    assert got.steps_done == 10 and got.unrecorded == () and got.last_skipped == -1
    assert got.next_gen == 5 and got.lease_epoch == 2 and got.run_id == RUN


def test_the_new_epoch_and_generation_exceed_any_seen_in_workers_or_run_dir():
    got = rebuild(trio(epoch=3), record(epoch=5, gen=4))
    assert got.lease_epoch == 6 and got.next_gen == 5
    got = rebuild([*trio(epoch=7), report("w9", gen=-1, rank=None, run=None)], record())
    assert got.lease_epoch == 8


def test_a_generation_the_run_dir_never_recorded_is_the_members_one():
    # The controller died while building generation 5: its workers entered it.
    got = rebuild(trio(gen=5), record(gen=4))
    assert got.members == ("w3", "w0", "w1") and got.next_gen == 6


def test_a_member_whose_group_never_formed_goes_last():
    got = rebuild([report("w0", gen=5, rank=None), report("w1", gen=5, rank=0)], record())
    assert got.members == ("w1", "w0")


def test_refused_when_the_run_dirs_newest_generation_has_no_live_worker():
    with pytest.raises(TakeoverRefused, match="no live worker is in generation 6"):
        rebuild(trio(), record(gen=6))
    with pytest.raises(TakeoverRefused, match="no live worker is in a generation"):
        rebuild([report("w5", gen=-1, rank=None, run=None)], record())


def test_refused_when_a_member_is_not_in_the_run_dirs_generation():
    with pytest.raises(TakeoverRefused, match=r"\['w7'\] are in generation 4"):
        rebuild([*trio(), report("w7", rank=3)], record())


def test_refused_when_members_share_a_rank():
    with pytest.raises(TakeoverRefused, match="distinct ranks"):
        rebuild([report("w0", rank=0), report("w1", rank=0)], record(members=("w0", "w1")))


def test_refused_when_members_were_told_different_leases():
    with pytest.raises(TakeoverRefused, match="different leases"):
        rebuild([report("w0", rank=0), report("w1", rank=1, epoch=2)],
                record(members=("w0", "w1")))


# ---- one run -------------------------------------------------------------------------------


def test_refused_when_a_worker_follows_another_run():
    with pytest.raises(TakeoverRefused, match=r"w1 follows run run-b.*another run"):
        rebuild([report("w0", rank=0), report("w1", rank=1, run="run-b")],
                record(members=("w0", "w1")))


def test_refused_for_a_run_dir_without_a_run_or_with_another_runs_ledger():
    with pytest.raises(TakeoverRefused, match="no run_start"):
        rebuild(trio(), RunRecord(run_id=None))
    with pytest.raises(TakeoverRefused, match="ledger was last written by run run-b"):
        rebuild(trio(), record(ledger_run="run-b", ledger_steps=3))
    # A job resumed in the run dir: the ledger is the earlier run's until it commits a step.
    resumed = rebuild(trio(), record(ledger_run="run-0", ledger_steps=0, earlier_runs=("run-0",)))
    assert resumed.ledger_steps == 0


# ---- steps and holders: the reconciliation's rules ----------------------------------------


def test_steps_a_member_applied_count_even_where_the_run_dir_has_no_record():
    # A collective completed on w0 and w3, not on w1; the controller died before recording.
    reports = [report("w0", rank=1, steps=12), report("w1", rank=2, steps=11, pending=11),
               report("w3", rank=0, steps=12)]
    got = rebuild(reports, record(steps_done=9))
    assert got.steps_done == 12 and got.unrecorded == (9, 10, 11)
    assert got.holders == ("w3", "w0") and got.behind == ("w1",)


def test_a_skip_the_workers_never_learnt_counts_and_its_pending_step_is_kept_by_holders():
    reports = [report("w0", rank=0, pending=10), report("w1", rank=1, pending=None)]
    got = rebuild(reports, record(members=("w0", "w1"), steps_done=11, last_skipped=10))
    assert got.steps_done == 11 and got.last_skipped == 10
    assert got.holders == ("w0",) and got.behind == ("w1",)  # w1 dropped it: behind


def test_refused_when_the_run_dir_committed_steps_no_member_holds():
    with pytest.raises(TakeoverRefused, match=r"records 12 steps committed.*applied 10"):
        rebuild(trio(), record(steps_done=12))
    with pytest.raises(TakeoverRefused, match="records 11 steps"):  # 11, but skipped 9 not 10
        rebuild(trio(), record(steps_done=11, last_skipped=9))


def test_members_without_the_state_are_behind_and_receive_it():
    reports = [report("w0", rank=0), report("w1", rank=1, steps=0),  # never received it
               report("w3", rank=2, steps=3, intact=False)]  # a restore broke off
    got = rebuild(reports, record())
    assert got.holders == ("w0",) and got.behind == ("w1", "w3")


def test_refused_when_members_differ_by_more_than_a_broken_collective_explains():
    with pytest.raises(TakeoverRefused, match="w1 applied 8 steps, w0 10"):
        rebuild([report("w0", rank=0), report("w1", rank=1, steps=8)],
                record(members=("w0", "w1")))


def test_refused_when_no_member_holds_the_state():
    with pytest.raises(TakeoverRefused, match="no live member of generation 4 holds"):
        rebuild([report("w0", rank=0, intact=False)], record(members=("w0",)))


def test_the_skipped_samples_are_the_run_dirs_and_those_the_members_were_told():
    got = rebuild(trio(skip=(3, 5)), record(skipped_samples=frozenset({5, 8})))
    assert got.skipped_samples == {3, 5, 8}


# ---- the reports of a sharded replica ------------------------------------------------------


def test_a_sharded_replicas_report_is_as_far_as_its_least_advanced_worker():
    leader = report("w0", steps=10, pending=10, epoch=2, skip=(1,))
    older = Lease(run_id=RUN, epoch=1)
    merged = leader.merged([replace(leader, name="w0.1", steps_done=9, lease=older),
                            replace(leader, name="w0.2", intact=False)])
    assert merged.name == "w0" and merged.workers == 3 and merged.steps_done == 9
    assert not merged.intact and merged.pending == 10 and merged.skipped_samples == (1,)
    assert merged.lease == older  # the oldest told: fenced as that
    lagging = leader.merged([replace(leader, gen=3, pending=None, lease=None)])
    assert lagging.gen == 3 and lagging.pending is None and lagging.lease is None


# ---- the run dir ---------------------------------------------------------------------------


def test_the_run_dir_is_replayed_from_its_newest_run(tmp_path):
    log = EventLog(tmp_path)
    log.emit("run_start", run_id="old")
    log.emit("generation", gen=9, workers=["w8"], epoch=4)
    log.emit("run_start", run_id=RUN)
    log.emit("generation", gen=0, workers=["w0", "w1"])  # written before epochs: 1
    for step in range(4):
        log.emit("step_committed", step=step)
    log.emit("restore", step=2)
    log.emit("step_committed", step=2)
    log.emit("sample_skipped", samples=[7, 9])
    log.emit("step_skipped", step=3)
    log.emit("steps_committed_by_save", steps=[4, 5], step=6)
    log.emit("generation", gen=1, workers=["w1", "w0"], epoch=2)
    ledger = Ledger(tmp_path, run_id=RUN)
    ledger.commit(4, gen=1)
    ledger.commit(5, gen=1)
    got = read_run_record(tmp_path)
    assert got == RunRecord(run_id=RUN, earlier_runs=("old",), gen=1, members=("w1", "w0"),
                            epoch=2, steps_done=6, last_skipped=3,
                            skipped_samples=frozenset({7, 9}), ledger_run=RUN, ledger_steps=6)
    assert read_run_record(tmp_path / "nothing") == RunRecord(run_id=None)


# ---- taking over: the controller's parts and the workers' fence ----------------------------


def test_membership_and_commit_log_restore_from_a_takeover(tmp_path):
    log, deadline = EventLog(tmp_path), StepDeadline(HangConfig())
    commits = CommitLog(log=log, deadline=deadline, micro_batch_size=4, ledger_dir=tmp_path,
                        run_id="new")
    group = Membership(config=RunConfig(steps=20, replicas=3, run_dir=tmp_path), log=log,
                       deadline=deadline, commit_log=commits, hooks=FaultHooks(None))
    reports = [report("w0", rank=1, steps=12), report("w1", rank=2, steps=11),
               report("w3", rank=0, steps=12, skip=(4,))]
    got = rebuild(reports, record(steps_done=11, last_skipped=7))
    commits.restore_from(got)
    group.restore_from(got, [handle("w0"), handle("w1"), handle("w3"), handle("w5")])
    assert group.names == ["w3", "w0", "w1"] and group.gen == 4
    assert [h.has_state for h in group.members] == [True, True, False]
    assert group.lease == Lease(run_id=RUN, epoch=2)
    assert commits.steps_done == 12 and commits.last_skipped == 7
    assert commits.skipped_samples == {4}
    assert commits.ledger is not None and commits.ledger.run_id == RUN


class FenceFreeStore:
    def check(self, keys: list[str]) -> bool:
        return False


def test_a_worker_refuses_a_join_from_a_controller_that_was_taken_over():
    worker = WorkerMembership("w0", FenceFreeStore(), sharded=False)
    worker.enter(4, lease=Lease(run_id=RUN, epoch=1))
    worker.enter(5, lease=Lease(run_id=RUN, epoch=2))  # the new controller
    assert worker.lease == Lease(run_id=RUN, epoch=2)
    with pytest.raises(StaleGeneration, match="lease epoch 2, refused a join from epoch 1"):
        worker.enter(6, lease=Lease(run_id=RUN, epoch=1))  # the old one, back from a pause
    assert worker.gen == 5
