"""A Lightning module trained elastic: a ``LightningModule`` and a ``LightningDataModule``
(or a dataset) as a planaria :class:`~planaria.TrainSpec`, run with :func:`~planaria.fit`.

Needs Lightning (``pip install "planaria[lightning]"``; ``lightning.pytorch`` or
``pytorch_lightning``, whichever is installed)::

    from planaria.integrations.lightning import fit_lightning

    result = fit_lightning(module=LitModel, datamodule=LitData, global_batch_size=256,
                           micro_batch_size=64, steps=1000, replicas=3, run_dir="runs/lit",
                           chaos="kill:w1@step300", eval_every=100)  # validation_step

``module`` and ``datamodule`` are factories (the classes themselves, or functions returning
an instance): each worker builds its own. What maps:

- ``training_step(batch, batch_idx)`` is the spec's loss, run once per micro-batch: its
  tensor, or the ``"loss"`` of its dict; planaria runs the backward (scaled to the micro-batch's
  share of the global batch, as Lightning's ``accumulate_grad_batches`` does), the reduction,
  the clipping and the update. ``batch_idx`` is 0: a micro-batch has no loader index;
  there is no ``Trainer``: ``self.global_step`` and ``self.current_epoch`` read 0, and
  ``self.trainer`` raises as it does outside one.
- ``self.log`` / ``self.log_dict`` in ``training_step`` become the step's metrics (the
  ``metrics`` of the ``step_committed`` event and of each ``StepResult``): the mean over the
  global batch's samples of the micro-batches' values (for a mean such as a loss or an
  accuracy, the global batch's value). Their options (``prog_bar``, ``on_epoch``,
  ``reduce_fx``, ``sync_dist``) are not used; log the same names at every step. (Without a
  Trainer, Lightning's own ``log`` warns and drops the value: the adapter replaces the
  instance's ``log`` and ``log_dict`` with recorders when it builds the module.)
- ``configure_optimizers``: one optimizer, given as an optimizer, a list of one, a dict
  ``{"optimizer", "lr_scheduler"}`` or ``([optimizer], [scheduler])``, with at most one
  scheduler, in a dict ``{"scheduler", "interval": "step", "frequency": 1}``: planaria steps
  the scheduler once per committed step, which is exactly that. Refused by name, with the
  reason: two optimizers, manual optimization (``automatic_optimization = False``), an
  ``"epoch"`` interval (Lightning's default for a bare scheduler), a frequency other than 1,
  and ``ReduceLROnPlateau`` (``reduce_on_plateau``, ``monitor``).
- The datamodule: each worker's dataset factory calls ``prepare_data()`` (make it safe to run
  in every worker, or download beforehand), ``setup("fit")`` (once: the eval set comes from
  the same datamodule) and ``train_dataloader()``, and takes the loader's ``dataset``
  (map-style: exactly-once needs an index) and its ``collate_fn``. planaria owns batching,
  order and sampling: the global batch, the micro-batches and the order come from
  planaria's plan (seeded, the same at any width), so the loader's ``batch_size``,
  ``shuffle``, ``sampler`` and ``num_workers`` are not used (a log line says so).
- ``validation_step(batch, batch_idx)`` is the spec's ``evaluate``, run under ``eval()``
  and ``no_grad`` (Lightning's validation uses ``inference_mode``: the same figures) on
  each eval batch, every ``eval_every`` committed steps (``fit_lightning(...,
  eval_every=N)``: the Trainer's ``val_check_interval`` counted in steps; a float, a
  fraction of an epoch, is refused) and on demand (``Job.evaluate()``); ``batch_idx`` is 0.
  What it logs with ``self.log`` / ``self.log_dict`` (the last value of each name) is the
  batch's figure, and planaria's figure is their mean weighted by the batches' sizes, over
  the whole eval set, the same at any width (``FitResult.evals``, the ``eval`` event).
  That is Lightning's epoch value of an ``on_epoch=True`` mean, which weights each batch
  by its size too, so a shorter last batch counts for its samples alone in both (as long
  as Lightning finds the batch size from the batch, or is told it by ``batch_size=``).
  The eval set is the datamodule's ``val_dataloader()`` (after ``setup("fit")``, as in
  Lightning's fit, on the datamodule that gave the training set) with its ``collate_fn``
  (``TrainSpec.eval_collate``), or ``val_dataset`` (batched by ``collate_fn``);
  ``eval_batch_size`` is the val loader's ``batch_size`` unless given (read on the
  calling process, which builds the datamodule once for it: ``prepare_data()``,
  ``setup("fit")``, ``val_dataloader()``; give ``eval_batch_size`` to skip that). The
  eval set is cut into batches by index and split over the replicas, so the val loader's
  sampler, ``drop_last`` and ``num_workers`` are not used. A ``validation_step`` with no
  eval set is not run, and an eval set with no ``validation_step`` is not used (said once
  by name, as Lightning skips its validation then).
- Not run: the ``Trainer``'s hooks (``on_train_batch_start``, ``on_before_optimizer_step``,
  ``on_validation_epoch_end``, ...: a log line names those the module overrides).
  ``configure_model()`` is called after the module is built. Dropout and other randomness
  draw from planaria's per-micro-batch streams (the same at any width), not Lightning's.
"""

from __future__ import annotations

import importlib
import logging
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from planaria.config import TrainSpec
from planaria.faults.errors import ConfigError
from planaria.fit import FitResult, fit
from planaria.integrations.lightning_data import LightningData
from planaria.integrations.lightning_optimizers import LightningOptimization, optimization_of

__all__ = [
    "LightningData",
    "LightningModel",
    "LightningOptimization",
    "TrainingStep",
    "ValidationStep",
    "check_module",
    "fit_lightning",
    "optimization_of",
    "spec_from_lightning",
]

INSTALL = 'pip install "planaria[lightning]"'


def _import_lightning() -> tuple[ModuleType, ...]:
    """Every Lightning package installed: a module may derive from either's LightningModule."""
    found = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            continue
    if not found:
        raise ImportError(
            "planaria.integrations.lightning needs Lightning (lightning.pytorch or "
            f"pytorch_lightning), which is not installed: {INSTALL}")
    return tuple(found)


LIGHTNING = _import_lightning()
MODULE_BASES: tuple[type, ...] = tuple(pl.LightningModule for pl in LIGHTNING)
"""The ``LightningModule`` classes a module may derive from."""

log = logging.getLogger(__name__)

# Trainer hooks a module may override that planaria does not run (named in a log line).
UNRUN_HOOKS = (
    "setup", "on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start",
    "on_train_batch_end", "on_before_backward", "on_after_backward", "on_before_zero_grad",
    "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step",
    "on_train_epoch_end", "on_train_end", "on_fit_end", "on_validation_start",
    "on_validation_epoch_start", "on_validation_batch_start", "on_validation_batch_end",
    "on_validation_epoch_end", "on_validation_end",
)
_said: set[str] = set()


def _say_once(message: str, *args: Any) -> None:
    if message not in _said:
        _said.add(message)
        log.warning(message, *args)


# ---- the module ------------------------------------------------------------------------------

def check_module(module: Any, *, evaluates: bool = False) -> None:
    """Raises :class:`ConfigError` for a module planaria cannot train as it is; logs, once,
    what it does not run (``validation_step`` without an eval set, the Trainer's hooks).
    ``evaluates``: the spec has an eval set."""
    base = next((b for b in MODULE_BASES if isinstance(module, b)), None)
    if base is None:
        raise ConfigError(
            f"module={type(module).__name__} is not valid: the module factory must return a "
            "LightningModule")
    if not module.automatic_optimization:
        raise ConfigError(
            f"{type(module).__name__}: manual optimization (automatic_optimization=False) is "
            "refused: its training_step calls manual_backward and optimizer.step itself, and "
            "planaria owns the reduction, the clipping, the non-finite check and the update "
            "of every step; port that step to TrainSpec(forward_backward=...), which may run "
            "several forwards and backwards")
    validation(module, evaluates)
    unrun = [h for h in UNRUN_HOOKS
             if getattr(type(module), h, None) is not getattr(base, h, None)]
    if unrun:
        _say_once("%s overrides Trainer hooks planaria does not run: %s", type(module).__name__,
                  ", ".join(unrun))


def has_validation_step(module_class: type) -> bool:
    """``module_class`` (a LightningModule class) overrides ``validation_step``."""
    return all(getattr(module_class, "validation_step", None)
               is not getattr(base, "validation_step", None) for base in MODULE_BASES)


def validation(module: Any, evaluates: bool) -> None:
    """What becomes of ``validation_step``, said once: not run without an eval set; with
    one but no ``validation_step``, the evaluations have no figures (Lightning skips its
    validation loop)."""
    name = type(module).__name__
    if has_validation_step(type(module)) and not evaluates:
        _say_once("%s.validation_step is not run: no eval set (give val_dataset=, or a "
                  "datamodule with val_dataloader())", name)
    elif evaluates and not has_validation_step(type(module)):
        _say_once("%s has no validation_step: its evaluations have no figures (Lightning "
                  "skips validation too)", name)


class LoggedValues:
    """What the module's ``self.log`` / ``self.log_dict`` recorded in one ``training_step``,
    as floats: installed on the module instance in place of its ``log`` and ``log_dict``."""

    _of: weakref.WeakKeyDictionary[Any, LoggedValues] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    @classmethod
    def install(cls, module: Any) -> None:
        logged = cls()
        module.log, module.log_dict = logged.log, logged.log_dict
        cls._of[module] = logged

    @classmethod
    def of(cls, module: Any) -> LoggedValues:
        logged = cls._of.get(module)
        if logged is None:
            raise ConfigError(
                f"model={type(module).__name__} is not valid here: TrainingStep runs the "
                "training_step of a module built by LightningModel (the spec's model factory); "
                "compile is not supported with the Lightning adapter")
        return logged

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}, ...): a tensor of {value.numel()} "
                                 "elements; log a scalar")
        try:
            self.values[name] = float(value)
        except (TypeError, ValueError) as err:
            raise ValueError(f"self.log({name!r}, {type(value).__name__}): planaria's metrics "
                             "take a number or a scalar tensor") from err

    def log_dict(self, dictionary: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value)


class LightningModel:
    """``TrainSpec.model``: builds the module in the worker, refuses what cannot map, calls
    ``configure_model()`` and captures its log calls (``evaluates``: the spec has an eval
    set)."""

    def __init__(self, factory: Callable[[], Any], *, evaluates: bool = False) -> None:
        self.factory, self.evaluates = factory, evaluates

    def __call__(self) -> Any:
        module = self.factory()
        check_module(module, evaluates=self.evaluates)
        module.configure_model()
        LoggedValues.install(module)
        return module


class TrainingStep:
    """``TrainSpec.loss``: ``training_step(batch, 0)``'s loss and what it logged."""

    def __call__(self, module: Any, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        logged = LoggedValues.of(module)
        logged.values = {}
        out = module.training_step(batch, 0)
        if isinstance(out, Mapping):
            if "loss" not in out:
                raise ValueError("training_step returned a dict without 'loss': return the "
                                 "loss, or a dict with it under 'loss'")
            out = out["loss"]
        if not isinstance(out, torch.Tensor):
            raise ValueError(
                f"training_step returned {type(out).__name__}: planaria needs a loss tensor "
                "for every micro-batch (Lightning skips a step on None; every replica of "
                "planaria runs the same steps, so a step cannot be skipped by one of them)")
        return out, logged.values


class ValidationStep:
    """``TrainSpec.evaluate``: what ``validation_step(batch, 0)`` logged, each value the
    batch's mean (planaria runs it under ``eval()`` and ``no_grad``; its return value is
    not used); nothing for a module without ``validation_step``."""

    def __call__(self, module: Any, batch: Any) -> dict[str, float]:
        logged = LoggedValues.of(module)
        logged.values = {}
        if has_validation_step(type(module)):
            module.validation_step(batch, 0)
        return logged.values


# ---- the spec and the run --------------------------------------------------------------------

def spec_from_lightning(
    module: Callable[[], Any],
    *,
    global_batch_size: int,
    micro_batch_size: int,
    datamodule: Callable[[], Any] | None = None,
    train_dataset: Any = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    val_dataset: Any = None,
    eval_batch_size: int | None = None,
    seed: int = 0,
    grad_clip_norm: float | None = None,
    precision: str | None = None,
    name: str = "lightning",
) -> TrainSpec:
    """The :class:`~planaria.TrainSpec` that trains ``module`` (a factory of a
    ``LightningModule``) on ``datamodule`` (a factory of a ``LightningDataModule``) or
    ``train_dataset``, and evaluates it with its ``validation_step`` on the datamodule's
    ``val_dataloader()`` or ``val_dataset``; see the module's docstring for what maps.
    ``eval_batch_size``: None, the val loader's ``batch_size`` (read from a datamodule
    built and set up here; ``micro_batch_size`` for ``val_dataset``). ``grad_clip_norm``
    is the Trainer's ``gradient_clip_val`` (norm clipping); ``precision`` planaria's
    (``"bf16"``, ``"fp16"`` or None)."""
    if not callable(module) or isinstance(module, MODULE_BASES):
        raise ConfigError(
            f"module={type(module).__name__} is not valid: give a factory (the class, or a "
            "function returning the module), so that each worker builds its own")
    if val_dataset is not None and datamodule is not None:
        raise ConfigError(
            "val_dataset is not valid with a datamodule (nor is it in Lightning's fit): the "
            "datamodule's eval set is its val_dataloader(); give val_dataset with "
            "train_dataset")
    data = LightningData(datamodule=datamodule, train_dataset=train_dataset,
                         collate_fn=collate_fn, val_dataset=val_dataset)
    evaluates = data.has_eval_set()
    if evaluates and isinstance(module, type) and not has_validation_step(module):
        _say_once("%s has no validation_step: the eval set is not used (Lightning skips "
                  "validation too)", module.__name__)
        evaluates = False
    if evaluates and eval_batch_size is None:
        eval_batch_size = data.val_batch_size()
    optimization = LightningOptimization()
    return TrainSpec(
        model=LightningModel(module, evaluates=evaluates),
        optimizer=optimization.optimizer,
        optimizer_gets="model",
        lr_scheduler=optimization.scheduler,
        loss=TrainingStep(),
        dataset=data.dataset,
        collate=data.collate if datamodule is not None or collate_fn is not None else None,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        eval_dataset=data.eval_dataset if evaluates else None,
        evaluate=ValidationStep() if evaluates else None,
        eval_batch_size=eval_batch_size if evaluates else None,
        eval_collate=data.eval_collate if evaluates and datamodule is not None else None,
        seed=seed,
        grad_clip_norm=grad_clip_norm,
        precision=precision,
        name=name,
    )


def fit_lightning(
    module: Callable[[], Any],
    *,
    global_batch_size: int,
    micro_batch_size: int,
    steps: int,
    replicas: int,
    run_dir: str | Path,
    datamodule: Callable[[], Any] | None = None,
    train_dataset: Any = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    val_dataset: Any = None,
    eval_batch_size: int | None = None,
    eval_every: int | None = None,
    seed: int = 0,
    grad_clip_norm: float | None = None,
    precision: str | None = None,
    name: str = "lightning",
    **fit_options: Any,
) -> FitResult:
    """Trains a Lightning module elastic: :func:`spec_from_lightning`, run with
    :func:`~planaria.fit` (``fit_options``: its keyword arguments, such as ``chaos``,
    ``policy``, ``checkpoint``, ``spares``). The global batch stays ``global_batch_size``
    whatever the number of replicas. ``eval_every``: run ``validation_step`` over the eval
    set every this many committed steps (the Trainer's ``val_check_interval`` counted in
    steps; its results in ``FitResult.evals``). Returns fit's :class:`~planaria.FitResult`;
    its ``state_dict`` is the module's (``module.load_state_dict(result.state_dict)``)."""
    if isinstance(eval_every, float):
        raise ConfigError(
            f"eval_every={eval_every!r} is refused: a float is Lightning's "
            "val_check_interval as a fraction of an epoch, and planaria counts evaluations "
            "in committed steps; give an int (an epoch is len(dataset) // global_batch_size "
            "steps)")
    spec = spec_from_lightning(
        module, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
        datamodule=datamodule, train_dataset=train_dataset, collate_fn=collate_fn,
        val_dataset=val_dataset, eval_batch_size=eval_batch_size, seed=seed,
        grad_clip_norm=grad_clip_norm, precision=precision, name=name)
    return fit(spec, steps=steps, replicas=replicas, run_dir=run_dir, eval_every=eval_every,
               **fit_options)
