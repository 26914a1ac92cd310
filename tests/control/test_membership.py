"""Membership's one wait for workers that become ready (planaria.control.membership), and
who holds the state, without Ray: a scripted pool stands in for the workers."""

from __future__ import annotations

from control_fakes import handle
from planaria.config import RunConfig
from planaria.control.commit_log import CommitLog
from planaria.control.hooks import FaultHooks
from planaria.control.membership import Membership
from planaria.control.policy import HangConfig
from planaria.control.pool import WorkerHandle
from planaria.control.watchdog import StepDeadline
from planaria.observe.events import EventLog


class ScriptedPool:
    """The pool's side of a wait: each poll hands over the next batch of ready workers;
    ``pending`` counts the starts still under way, ``standby`` the warm spares."""

    def __init__(self, batches: list[list[WorkerHandle]], *, pending: int = 0,
                 spares_starting: int = 0) -> None:
        self.batches = list(batches)
        self.pending_count = pending
        self.spares_starting = spares_starting
        self.standby: list[WorkerHandle] = []
        self.polls = 0

    def poll(self, timeout_s: float = 0.0) -> list[WorkerHandle]:
        self.polls += 1
        batch = self.batches.pop(0) if self.batches else []
        self.pending_count = max(0, self.pending_count - len(batch))
        return batch


def membership(tmp_path, pool: ScriptedPool, *, replicas: int = 3,
               spares: int = 0) -> Membership:
    log = EventLog(tmp_path)
    deadline = StepDeadline(HangConfig())
    commits = CommitLog(log=log, deadline=deadline, micro_batch_size=4, ledger_dir=None,
                        run_id="r")
    out = Membership(config=RunConfig(steps=1, replicas=replicas, run_dir=tmp_path,
                                      spares=spares),
                     log=log, deadline=deadline, commit_log=commits, hooks=FaultHooks(None))
    out.pool = pool  # type: ignore[assignment]
    return out


def test_waiting_for_starts_ends_once_all_are_ready(tmp_path):
    pool = ScriptedPool([[handle("w0")], [], [handle("w1"), handle("w2")]], pending=3)
    ready = membership(tmp_path, pool).wait_ready(3, timeout_s=60)
    assert [h.name for h in ready] == ["w0", "w1", "w2"] and pool.polls == 3


def test_waiting_for_starts_ends_when_none_is_coming(tmp_path):
    pool = ScriptedPool([[handle("w0")]], pending=1)  # the other starts failed
    ready = membership(tmp_path, pool).wait_ready(3, timeout_s=60)
    assert [h.name for h in ready] == ["w0"] and pool.polls == 1


def test_waiting_for_width_admits_each_replacement_as_it_comes(tmp_path):
    pool = ScriptedPool([[], [handle("w3")], [handle("w4")]], pending=2)
    group = membership(tmp_path, pool, replicas=4)
    group.add([handle("w0"), handle("w1")])
    admitted: list[list[str]] = []

    def admit(ready: list[WorkerHandle]) -> None:
        admitted.append([h.name for h in ready])
        group.add(ready)

    assert group.wait_for_width(4, timeout_s=60, admit=admit) == 4
    assert admitted == [["w3"], ["w4"]]


def test_waiting_for_width_ends_when_nothing_is_coming(tmp_path):
    pool = ScriptedPool([], pending=0)
    group = membership(tmp_path, pool)
    group.add([handle("w0")])
    assert group.wait_for_width(3, timeout_s=60, admit=group.add) == 1
    assert pool.polls == 1


def test_waiting_for_spares_ends_when_their_starts_failed(tmp_path):
    pool = ScriptedPool([], spares_starting=0)
    group = membership(tmp_path, pool, spares=2)
    assert group.wait_for_spares(timeout_s=60, admit=group.add) == 0
    pool.standby = [handle("w5"), handle("w6")]
    assert group.wait_for_spares(timeout_s=60, admit=group.add) == 2


def test_members_that_hold_the_state_are_marked_by_name(tmp_path):
    group = membership(tmp_path, ScriptedPool([]))
    group.add([handle("w0"), handle("w1", has_state=False), handle("w2")])
    group.set_holding(["w2"], False)
    assert [h.has_state for h in group.members] == [True, False, False]
    group.set_holding(group.names, True)
    assert all(h.has_state for h in group.members)
    assert group.with_followers(["w0"]) == ["w0"]  # one worker per replica
