"""Saves that do not commit: each is reported, and saves failing in a row escalate (the run
goes on without durability, said loudly; with ``on_failing="stop"`` the job stops)."""

from __future__ import annotations

import logging

from planaria.checkpoint.config import CheckpointConfig
from planaria.checkpoint.errors import CheckpointError
from planaria.checkpoint.host import EventSink
from planaria.observe.logs import RESTATES

__all__ = ["SaveFailures"]

_log = logging.getLogger("planaria.checkpoint")


class SaveFailures:
    """The tally of saves under ``root`` that did not commit since the last one that did."""

    def __init__(self, config: CheckpointConfig, root: str, log: EventSink) -> None:
        self.config = config
        self.root = root
        self.log = log
        self.in_a_row = 0
        self.last: str | None = None
        """The last failure, ``"step N: why"``."""
        self._stop_reason: str | None = None

    def committed(self) -> None:
        """A save committed: the tally starts again."""
        self.in_a_row = 0

    def failed(self, step: int, reason: str, why: str, *, steps_done: int,
               newest: tuple[int, str | None] | None) -> None:
        """The save of ``step`` (taken for ``reason``) will not commit, because ``why``;
        the job is at ``steps_done`` and its newest committed checkpoint is ``newest``
        (step, path). Logs ``checkpoint_failed``; escalates once ``max_failed_saves`` failed
        in a row."""
        self.last = f"step {step}: {why}"
        _log.warning("checkpoint of step %d not committed: %s", step, why,
                     extra={RESTATES: "checkpoint_failed"})
        self.log.emit("checkpoint_failed", step=step, error=why, reason=reason)
        self.in_a_row += 1
        if self.in_a_row >= self.config.max_failed_saves:
            self._escalate(why, steps_done, newest)

    def _escalate(self, why: str, steps_done: int, newest: tuple[int, str | None] | None) -> None:
        """Saves keep failing: the run goes on without durability. Said loudly, and with
        ``on_failing="stop"`` the job stops (at the next boundary, where this is raised)."""
        described = "none" if newest is None else f"step {newest[0]} ({newest[1]})"
        message = (f"{self.in_a_row} checkpoints in a row were not committed under "
                   f"{self.root} (last: {why}); the newest committed one is {described}, and "
                   f"the job is at step {steps_done}: free space or fix the storage "
                   "(a job killed now loses every step since), or give the job another root")
        self.log.emit("checkpoints_failing", failed=self.in_a_row,
                      newest_step=None if newest is None else newest[0], step=steps_done,
                      error=why, action=self.config.on_failing)
        _log.error("%s", message)
        if self.config.on_failing == "stop":
            self._stop_reason = message

    def raise_if_failing(self) -> None:
        """Raises the CheckpointError of ``on_failing="stop"`` once saves failed too often."""
        reason, self._stop_reason = self._stop_reason, None
        if reason is not None:
            raise CheckpointError(f"{reason} (CheckpointConfig(on_failing='stop'))")
