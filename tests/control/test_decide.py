"""The recovery policy's decisions, on plain values (no Ray): planaria.control.decide."""

from __future__ import annotations

import pytest

from planaria import RecoveryPolicy
from planaria.control.attribution import Blame
from planaria.control.decide import Action, Decision, decide
from planaria.faults.errors import (
    AllReplicasLost,
    Failure,
    InfrastructureError,
    NonFiniteLoss,
    Preempted,
    UserCodeError,
    WorkerLost,
    WorkFault,
)


def _decide(failure: Failure, *, policy: RecoveryPolicy | None = None, blame: Blame | None = None,
            failures_before: int = 0, evacuating: bool = False,
            holders_left: bool = True) -> Decision:
    return decide(failure, blame=blame, policy=policy or RecoveryPolicy(),
                  failures_before=failures_before, evacuating=evacuating,
                  holders_left=holders_left)


def _lost() -> WorkerLost:
    return WorkerLost("w1 died", workers=("w1",))


def test_a_lost_worker_is_evicted_and_the_survivors_go_on_by_default() -> None:
    d = _decide(_lost())
    assert d == Decision(action=Action.RESIZE, counted=True, evict=True)


@pytest.mark.parametrize(("on_lost", "action", "keep"), [
    ("pause", Action.PAUSE, False), ("restore", Action.RESTORE, True),
    ("abort", Action.ABORT, False)])
def test_the_policy_names_what_follows_a_lost_worker(on_lost: str, action: Action,
                                                     keep: bool) -> None:
    d = _decide(_lost(), policy=RecoveryPolicy(on_worker_lost=on_lost))  # type: ignore[arg-type]
    assert (d.action, d.counted, d.evict, d.keep_survivors) == (action, True, True, keep)
    if action is Action.ABORT:
        assert "on_worker_lost='abort'" in d.reason


def test_no_holder_left_restores_whatever_the_policy_says() -> None:
    for on_lost in ("resize", "pause", "restore", "abort"):
        d = _decide(_lost(), policy=RecoveryPolicy(on_worker_lost=on_lost),  # type: ignore[arg-type]
                    holders_left=False)
        assert d == Decision(action=Action.RESTORE, counted=True, evict=True)
    d = _decide(AllReplicasLost("all lost", workers=("w0", "w1")))
    assert d == Decision(action=Action.RESTORE, counted=True, evict=True)


def test_one_failure_too_many_aborts_before_anyone_is_evicted() -> None:
    policy = RecoveryPolicy(max_failures=2)
    assert _decide(_lost(), policy=policy, failures_before=1).action is Action.RESIZE
    d = _decide(_lost(), policy=policy, failures_before=2)
    assert (d.action, d.counted, d.evict) == (Action.ABORT, True, False)
    assert "3 failures, more than max_failures=2" in d.reason


def test_the_retry_policy_hook_sees_the_count_with_this_failure() -> None:
    seen: list[int] = []

    def twice(n: int, failure: Failure) -> bool:
        seen.append(n)
        return n <= 2

    policy = RecoveryPolicy(retry_policy=twice)
    assert _decide(_lost(), policy=policy, failures_before=1).action is Action.RESIZE
    d = _decide(_lost(), policy=policy, failures_before=2)
    assert (d.action, d.evict, d.reason) == (Action.ABORT, False,
                                            "the retry_policy hook declined to retry")
    assert seen == [2, 3]


def test_a_first_sighting_of_an_infrastructure_error_runs_the_work_again() -> None:
    err = InfrastructureError("NCCL timeout", workers=("w1",))
    assert _decide(err, blame=Blame.RETRY) == Decision(action=Action.RETRY_ELSEWHERE,
                                                       counted=True)
    assert _decide(err, blame=Blame.WORKER).action is Action.RESIZE


def test_what_the_work_or_the_user_caused_is_not_counted_as_a_failure() -> None:
    policy = RecoveryPolicy(max_failures=0)  # a counted failure would abort
    assert _decide(WorkFault("bad sample", workers=("w1",)), policy=policy) == Decision(
        action=Action.WORK_FAULT)
    assert _decide(UserCodeError("bug", workers=("w1",)), policy=policy) == Decision(
        action=Action.ABORT_USER_CODE)
    assert _decide(NonFiniteLoss("nan", workers=("w0",)), policy=policy) == Decision(
        action=Action.NONFINITE)


def test_a_preemption_wave_evacuates_and_a_lone_notice_resizes() -> None:
    notice = Preempted("w1 preempted", workers=("w1",))
    assert _decide(notice, evacuating=True) == Decision(action=Action.EVACUATE)
    assert _decide(notice, evacuating=False).action is Action.RESIZE
