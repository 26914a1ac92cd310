"""What the recovery policy does about one failure: the decision alone, without Ray.

:func:`decide` maps a classified failure, the judgement of who is to blame and the job's
counts to one :class:`Action`; :class:`~planaria.control.recovery.Recovery` carries it out
on the controller's parts. Keeping the decision here lets every rule be tested on plain
values (``tests/control/test_decide.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planaria.control.attribution import Blame
from planaria.faults.errors import (
    AllReplicasLost,
    Failure,
    NonFiniteLoss,
    Preempted,
    UserCodeError,
    WorkFault,
)

if TYPE_CHECKING:
    from planaria.control.policy import RecoveryPolicy

__all__ = ["Action", "Decision", "decide"]


class Action(enum.Enum):
    """One thing the recovery does about a failure."""

    WORK_FAULT = "work_fault"
    """The work is to blame (the same samples failed on several workers): skip or stop."""
    EVACUATE = "evacuate"
    """Every holder of the state got a preemption notice: save beside the leavers, go on."""
    ABORT_USER_CODE = "abort_user_code"
    """A bug in the user's code: save what is safe and raise it."""
    NONFINITE = "nonfinite"
    """A non-finite loss or gradient: the policy's ``on_nonfinite``."""
    ABORT = "abort"
    """Give up (``reason`` says why)."""
    RETRY_ELSEWHERE = "retry_elsewhere"
    """First sighting of an infrastructure error: run the work again, evict no one."""
    RESTORE = "restore"
    """Evict the failed workers and restore a checkpoint into the members (``keep``: the
    survivors stay and replacements fill the width; otherwise no one holds the state)."""
    RESIZE = "resize"
    """Evict the failed workers and go on with the survivors (and any replacement ready)."""
    PAUSE = "pause"
    """Evict the failed workers and wait for replacements up to the width asked for."""


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What to do (``action``), and: ``counted``, whether the failure counts towards
    ``max_failures``; ``evict``, whether the failed workers are evicted (and replacements
    asked for) first; ``keep_survivors`` for a restore; ``reason`` for an abort."""

    action: Action
    counted: bool = False
    evict: bool = False
    keep_survivors: bool = False
    reason: str = ""


def decide(failure: Failure, *, blame: Blame | None, policy: RecoveryPolicy,
           failures_before: int, evacuating: bool, holders_left: bool) -> Decision:
    """The policy's action for ``failure``.

    ``blame``: the attribution's verdict on a raised infrastructure error (None: not
    judged); ``failures_before``: the failures counted so far; ``evacuating``: a
    preemption wave takes every holder of the state; ``holders_left``: a member other than
    ``failure.workers`` holds the committed state. May call ``policy.retry_policy``.
    """
    if isinstance(failure, WorkFault):
        return Decision(action=Action.WORK_FAULT)
    if isinstance(failure, Preempted) and evacuating:
        return Decision(action=Action.EVACUATE)
    if isinstance(failure, UserCodeError):
        return Decision(action=Action.ABORT_USER_CODE)
    if isinstance(failure, NonFiniteLoss):
        return Decision(action=Action.NONFINITE)
    failures = failures_before + 1
    if failures > policy.max_failures:
        return Decision(action=Action.ABORT, counted=True, reason=(
            f"{failures} failures, more than max_failures={policy.max_failures}"))
    if policy.retry_policy is not None and not policy.retry_policy(failures, failure):
        return Decision(action=Action.ABORT, counted=True,
                        reason="the retry_policy hook declined to retry")
    if blame is Blame.RETRY:
        return Decision(action=Action.RETRY_ELSEWHERE, counted=True)
    if isinstance(failure, AllReplicasLost) or not holders_left:
        return Decision(action=Action.RESTORE, counted=True, evict=True)
    action = policy.on_worker_lost
    if action == "abort":
        return Decision(action=Action.ABORT, counted=True, evict=True,
                        reason="on_worker_lost='abort'")
    if action == "restore":
        return Decision(action=Action.RESTORE, counted=True, evict=True, keep_survivors=True)
    return Decision(action=Action.PAUSE if action == "pause" else Action.RESIZE, counted=True,
                    evict=True)
