"""Lightning's ``configure_optimizers``, in every documented form, as planaria's optimizer
and LR scheduler factories (``TrainSpec(optimizer_gets="model", lr_scheduler=...)``).

planaria steps the scheduler once per committed step, which is exactly Lightning's
``{"scheduler": s, "interval": "step", "frequency": 1}``; what cannot be run as Lightning
would (two optimizers, an ``"epoch"`` interval, another frequency, ``ReduceLROnPlateau``) is
refused by name with the reason (:class:`~planaria.faults.errors.ConfigError`). Needs
nothing of Lightning itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from planaria.faults.errors import ConfigError

__all__ = ["LightningOptimization", "optimization_of"]


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer)


def _split(conf: Any) -> tuple[list[Any], list[Any]]:
    """configure_optimizers' return value, in every documented form: (optimizers, schedulers)."""
    if conf is None:
        raise ConfigError(
            "configure_optimizers returned None (Lightning then trains without an optimizer): "
            "planaria needs one optimizer")
    if _is_optimizer(conf):
        return [conf], []
    if isinstance(conf, Mapping):
        if "optimizer" not in conf:
            raise ConfigError("configure_optimizers returned a dict without 'optimizer'")
        if "monitor" in conf:
            raise ConfigError(
                "configure_optimizers: 'monitor' (a scheduler on a monitored metric, "
                "ReduceLROnPlateau) is refused: planaria steps the scheduler once per "
                "committed step, without a metric")
        scheduler = conf.get("lr_scheduler")
        return [conf["optimizer"]], [] if scheduler is None else [scheduler]
    if isinstance(conf, (list, tuple)):
        if len(conf) == 2 and all(isinstance(c, (list, tuple)) for c in conf):
            return list(conf[0]), list(conf[1])
        if all(_is_optimizer(c) for c in conf):
            return list(conf), []
        if all(isinstance(c, Mapping) for c in conf):
            parts = [_split(c) for c in conf]
            return [o for p in parts for o in p[0]], [s for p in parts for s in p[1]]
    raise ConfigError(
        f"configure_optimizers returned {type(conf).__name__}, which is none of Lightning's "
        "forms: an optimizer, a list of optimizers, ([optimizers], [schedulers]) or a dict "
        "{'optimizer': ..., 'lr_scheduler': ...}")


def _scheduler_of(entry: Any, optimizer: Any) -> Any:
    if isinstance(entry, Mapping):
        scheduler = entry.get("scheduler")
        interval, frequency = entry.get("interval", "epoch"), entry.get("frequency", 1)
        plateau = bool(entry.get("reduce_on_plateau", False)) or "monitor" in entry
    else:
        scheduler, interval, frequency, plateau = entry, "epoch", 1, False
    if plateau or isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError(
            "configure_optimizers: reduce_on_plateau (ReduceLROnPlateau, or a 'monitor') is "
            "refused: it steps on a monitored metric, and planaria steps the scheduler once "
            "per committed step, without a metric")
    if interval != "step":
        raise ConfigError(
            f"configure_optimizers: the scheduler's interval={interval!r} is refused (it is "
            "Lightning's default for a scheduler given without a dict): planaria steps the "
            "scheduler once per committed step; return {'optimizer': opt, 'lr_scheduler': "
            "{'scheduler': sched, 'interval': 'step'}} with the schedule counted in steps "
            "(an epoch is dataset size / global_batch_size steps)")
    if frequency != 1:
        raise ConfigError(
            f"configure_optimizers: the scheduler's frequency={frequency!r} is refused: "
            "planaria steps the scheduler at every committed step; count the schedule in "
            "steps with frequency 1")
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise ConfigError("configure_optimizers: the scheduler is not built on the optimizer "
                          "returned with it")
    return scheduler


def optimization_of(conf: Any) -> tuple[Any, Any | None]:
    """(optimizer, scheduler or None) from what ``configure_optimizers`` returned; raises
    :class:`ConfigError` for what planaria cannot run as Lightning would."""
    optimizers, schedulers = _split(conf)
    if len(optimizers) != 1 or not _is_optimizer(optimizers[0]):
        raise ConfigError(
            f"configure_optimizers returned {len(optimizers)} optimizers: planaria trains "
            "with one (Lightning runs several only with manual optimization, which planaria "
            "refuses); put the parameters in groups of one optimizer")
    if len(schedulers) > 1:
        raise ConfigError(
            f"configure_optimizers returned {len(schedulers)} schedulers: planaria steps one "
            "(chain them with torch.optim.lr_scheduler.SequentialLR or ChainedScheduler)")
    optimizer = optimizers[0]
    return optimizer, _scheduler_of(schedulers[0], optimizer) if schedulers else None


class LightningOptimization:
    """``TrainSpec.optimizer`` (with ``optimizer_gets="model"``) and ``lr_scheduler`` from
    ``configure_optimizers``: :meth:`optimizer` calls it and keeps the scheduler for
    :meth:`scheduler`, which planaria calls next with that optimizer."""

    def __init__(self) -> None:
        self.pending: dict[int, Any] = {}

    def optimizer(self, module: Any) -> Any:
        optimizer, scheduler = optimization_of(module.configure_optimizers())
        self.pending[id(optimizer)] = scheduler
        return optimizer

    def scheduler(self, optimizer: Any) -> Any:
        if id(optimizer) not in self.pending:
            raise ConfigError("the Lightning scheduler factory was called with an optimizer "
                              "its optimizer factory did not build")
        return self.pending.pop(id(optimizer))
