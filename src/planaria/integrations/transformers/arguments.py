"""``TrainingArguments`` to planaria: :func:`plan_training` checks every field (see
:mod:`planaria.integrations.transformers.fields`) and maps the honoured ones to a
:class:`TrainingPlan`."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from planaria.checkpoint.config import CheckpointConfig
from planaria.faults.errors import ConfigError
from planaria.integrations.transformers.factories import AdamWFactory, SchedulerFactory
from planaria.integrations.transformers.fields import refuse_unhonoured

__all__ = ["REPORTED", "TrainingPlan", "plan_evaluation", "plan_training", "report_trackers"]

REPORTED = ("tensorboard", "wandb", "mlflow")
"""The ``report_to`` values planaria's own trackers take (planaria.observe.trackers)."""


def report_trackers(args: Any) -> list[str]:
    """``args.report_to`` as tracker names ("all" is every tracker planaria has)."""
    report_to = args.report_to
    names = [str(r) for r in ([report_to] if isinstance(report_to, str) else report_to or [])
             if r != "none"]
    return list(REPORTED) if names == ["all"] else names

_log = logging.getLogger(__name__)

OPTIMIZERS = {"adamw_torch": False, "adamw_torch_fused": True}  # name -> fused


@dataclass(frozen=True, kw_only=True)
class TrainingPlan:
    """What a ``TrainingArguments`` becomes in planaria."""

    steps: int
    global_batch_size: int
    micro_batch_size: int
    optimizer: AdamWFactory
    scheduler: SchedulerFactory
    learning_rate: float
    grad_clip_norm: float | None
    seed: int
    precision: str | None
    logging_steps: int | None
    """on_log every this many steps; None: never (logging_strategy='no')."""
    logging_first_step: bool
    save_every: int | None
    """A checkpoint every this many steps; None: no periodic checkpoint."""
    keep_last: int | None
    compile: bool
    compile_options: dict[str, Any] | None
    use_cache: bool | None

    def checkpoint(self) -> CheckpointConfig | None:
        """The CheckpointConfig ``save_strategy`` / ``save_steps`` / ``save_total_limit``
        ask for (None: no periodic saves)."""
        if self.save_every is None:
            return None
        return CheckpointConfig(every=self.save_every, keep_last=self.keep_last)


def plan_training(args: Any, *, replicas: int, num_samples: int) -> TrainingPlan:
    """Maps ``args`` (a ``TrainingArguments``) for a run starting at ``replicas`` replicas on
    a dataset of ``num_samples`` samples; a field planaria cannot honour is a
    :class:`ConfigError` naming it."""
    refuse_unhonoured(args)
    _refuse_values(args)
    micro = int(args.per_device_train_batch_size)
    global_batch = micro * int(args.gradient_accumulation_steps) * replicas
    if args.max_steps is not None and args.max_steps > 0:
        steps = int(args.max_steps)
    else:
        steps = math.ceil(float(args.num_train_epochs) * num_samples / global_batch)
        if steps < 1:
            raise ConfigError(f"num_train_epochs={args.num_train_epochs!r} is not valid: it "
                              "makes no step; give max_steps or more epochs")
    warmup = args.get_warmup_steps(steps)  # Trainer's rule (and transformers 4's warmup_ratio)
    optim = _plain(args.optim)
    logging_strategy = _plain(args.logging_strategy)
    save_strategy = _plain(args.save_strategy)
    compile_options = {k: v for k, v in (("backend", args.torch_compile_backend),
                                         ("mode", args.torch_compile_mode)) if v is not None}
    _log.info("ElasticTrainer: global batch %d (%d per device x %d accumulation x %d replicas "
              "at start); it stays %d when the width changes", global_batch, micro,
              args.gradient_accumulation_steps, replicas, global_batch)
    return TrainingPlan(
        steps=steps,
        global_batch_size=global_batch,
        micro_batch_size=micro,
        optimizer=AdamWFactory(lr=float(args.learning_rate),
                               betas=(float(args.adam_beta1), float(args.adam_beta2)),
                               eps=float(args.adam_epsilon),
                               weight_decay=float(args.weight_decay), fused=OPTIMIZERS[optim]),
        scheduler=SchedulerFactory(name=_plain(args.lr_scheduler_type), warmup_steps=warmup,
                                   training_steps=steps, kwargs=args.lr_scheduler_kwargs or None),
        learning_rate=float(args.learning_rate),
        grad_clip_norm=float(args.max_grad_norm) if args.max_grad_norm else None,
        seed=int(args.seed),
        precision="bf16" if args.bf16 else "fp16" if args.fp16 else None,
        logging_steps=(None if logging_strategy == "no" else _every(args.logging_steps, steps)),
        logging_first_step=bool(args.logging_first_step),
        save_every=None if save_strategy == "no" else _every(args.save_steps, steps),
        keep_last=args.save_total_limit,
        compile=bool(args.torch_compile),
        compile_options=compile_options or None,
        use_cache=getattr(args, "use_cache", None),
    )


def plan_evaluation(args: Any, eval_dataset: Any, compute_metrics: Any, *, steps: int,
                    steps_per_epoch: int) -> int | None:
    """Evaluation while training: ``eval_strategy`` / ``eval_steps`` as planaria's
    ``eval_every`` (None: no evaluation). The figure is the eval set's loss (the model's
    own, ``eval_loss``), a mean over its batches weighted by their samples."""
    strategy = _plain(getattr(args, "eval_strategy", getattr(args, "evaluation_strategy", "no")))
    if strategy == "no":
        return None
    if eval_dataset is None:
        raise ConfigError(f"eval_strategy={strategy!r} is not valid without an eval_dataset "
                          "(as for Trainer): give eval_dataset=..., or eval_strategy='no'")
    if compute_metrics is not None:
        raise ConfigError(
            "compute_metrics is not valid with ElasticTrainer: it needs every prediction of "
            "the eval set gathered in one process, while planaria's evaluation reduces each "
            "batch's figures over the live replicas; the eval loss is reported (eval_loss). "
            "Evaluate the saved output_dir with Trainer.evaluate() for other metrics")
    if strategy == "epoch":
        return max(1, steps_per_epoch)
    every = args.eval_steps if args.eval_steps is not None else args.logging_steps
    if isinstance(every, float) and every < 1:
        every = math.ceil(every * steps)
    return max(1, int(every))


def _refuse_values(args: Any) -> None:
    """The honoured fields whose value planaria cannot honour."""
    optim = _plain(args.optim)
    if optim not in OPTIMIZERS:
        raise ConfigError(
            f"optim={optim!r} is not valid: ElasticTrainer builds torch's AdamW only "
            "('adamw_torch', or 'adamw_torch_fused'); other optimizers are not mapped yet "
            "(write a TrainSpec with your optimizer factory)"
        )
    report_to = args.report_to
    unknown = [r for r in report_trackers(args) if r not in REPORTED]
    if unknown:
        raise ConfigError(
            f"report_to={report_to!r} is not valid: planaria's trackers are "
            f"{', '.join(REPORTED)} (fed from the controller's events); not {unknown}"
        )
    for name, allowed in (("logging_strategy", ("steps", "no")),
                          ("save_strategy", ("steps", "no"))):
        value = _plain(getattr(args, name))
        if value not in allowed:
            raise ConfigError(f"{name}={value!r} is not valid: ElasticTrainer takes "
                              f"{' or '.join(map(repr, allowed))} (planaria counts steps, "
                              "not epochs: a global batch may straddle two epochs)")
    if _plain(args.lr_scheduler_type) == "reduce_lr_on_plateau":
        raise ConfigError("lr_scheduler_type='reduce_lr_on_plateau' is not valid: it steps on "
                          "evaluation metrics, and ElasticTrainer does not evaluate yet")
    if args.bf16 and args.fp16:
        raise ConfigError("bf16=True with fp16=True is not valid: choose one precision")
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} is not valid: an integer >= 1")


def _every(value: float, steps: int) -> int:
    """Trainer's ``*_steps``: an integer, or a float < 1 as a ratio of the run's steps."""
    return max(1, math.ceil(value * steps)) if 0 < value < 1 else max(1, int(value))


def _plain(value: Any) -> str:
    """An enum's value (``SchedulerType.LINEAR`` -> ``'linear'``) or the string itself."""
    return str(getattr(value, "value", value))
