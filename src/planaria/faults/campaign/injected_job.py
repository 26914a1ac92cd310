"""What the campaign's injector reads of the job it is a hook of, and waits on.

:class:`InjectedJob` is the seam between the campaign and the controller: the injector
(:class:`~planaria.faults.campaign.inject.Injector`) and its parts take it, never the whole
``Job`` (which is one: :func:`planaria.faults.campaign.job.run_job` checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from planaria.config import RunConfig, TrainSpec
from planaria.control.policy import HangConfig
from planaria.data.plan import DataPlan
from planaria.wire.state_reports import Setup

__all__ = ["InjectedJob", "InjectedWorker"]


class InjectedWorker(Protocol):
    """A member (or a standby spare) of the job."""

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int | None:
        """Its process (None until it is started)."""

    @property
    def info(self) -> Setup | None:
        """What it reported when it became ready (None before)."""


class _Pool(Protocol):
    @property
    def standby(self) -> Sequence[InjectedWorker]:
        """The warm spares ready to take a member's place."""


class _StepDeadline(Protocol):
    @property
    def seconds(self) -> float:
        """The step deadline in force (learned from the steps' times)."""


class _Departures(Protocol):
    @property
    def draining(self) -> set[str]:
        """Members a preemption notice drains at the next boundary."""


class InjectedJob(Protocol):
    """A running job, read at its boundaries (between autonomous runs of steps) and in its
    save and join phases. Its two waits block the caller until the job is back at
    ``width`` replicas, or its spares are warm, or ``timeout_s`` passed, and return the
    count reached (a timeout is no error); a Failure meanwhile is raised."""

    @property
    def steps_done(self) -> int:
        """Steps committed."""

    @property
    def names(self) -> list[str]:
        """The members' names, by rank."""

    @property
    def members(self) -> Sequence[InjectedWorker]:
        """The members, by rank."""

    @property
    def width(self) -> int: ...

    @property
    def departures(self) -> _Departures: ...

    @property
    def pool(self) -> _Pool: ...

    @property
    def plan(self) -> DataPlan | None:
        """The data plan (set once the job started)."""

    @property
    def deadline(self) -> _StepDeadline: ...

    @property
    def hang(self) -> HangConfig: ...

    @property
    def spec(self) -> TrainSpec: ...

    @property
    def config(self) -> RunConfig: ...

    def wait_for_width(self, width: int, *, timeout_s: float) -> int: ...

    def wait_for_spares(self, *, timeout_s: float) -> int: ...
