""":class:`ElasticTrainer`: what ``transformers.Trainer`` takes, trained by :func:`planaria.fit`."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn
from transformers import TrainingArguments, default_data_collator
from transformers.trainer_utils import TrainOutput

from planaria.checkpoint.config import CheckpointConfig
from planaria.config import TrainSpec
from planaria.control.policy import RecoveryPolicy
from planaria.faults.chaos import ChaosPlan
from planaria.faults.errors import ConfigError
from planaria.fit import FitResult, fit
from planaria.integrations.transformers.arguments import (
    TrainingPlan,
    plan_evaluation,
    plan_training,
    report_trackers,
)
from planaria.integrations.transformers.callbacks import CallbackBridge
from planaria.integrations.transformers.factories import (
    ColumnFilter,
    DatasetSource,
    ModelFromWeights,
    ModelInit,
    eval_loss,
    model_loss,
)
from planaria.observe.trackers import TrackerOptions

__all__ = ["ElasticTrainer"]

_log = logging.getLogger(__name__)

_LABEL_COLUMNS = ("label", "label_ids", "labels")


class ElasticTrainer:
    """``transformers.Trainer``'s arguments, run elastic: ``train()`` trains through
    :func:`planaria.fit` on ``replicas`` Ray workers, recovering from lost workers.

    Trainer's positional order is kept. planaria's options are keyword-only: ``replicas``,
    ``spares``, ``chaos``, ``checkpoint`` (a CheckpointConfig; it replaces the one
    ``save_strategy`` / ``save_steps`` ask for), ``policy``, ``run_dir`` (default
    ``args.output_dir/planaria``) and any further :class:`~planaria.RunConfig` field
    (``use_gpu``, ``ledger``, ...). What is refused, and why, is a ConfigError at
    construction; see :mod:`planaria.integrations.transformers.fields`.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable[[], nn.Module] | None = None,
        compute_loss_func: Callable[..., Any] | None = None,
        compute_metrics: Callable[..., Any] | None = None,
        callbacks: Sequence[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Callable[..., Any] | None = None,
        *,
        tokenizer: Any = None,
        replicas: int,
        spares: int = 0,
        chaos: ChaosPlan | str | None = None,
        checkpoint: CheckpointConfig | None = None,
        policy: RecoveryPolicy | None = None,
        run_dir: str | Path | None = None,
        **options: Any,
    ) -> None:
        self.args = args if args is not None else TrainingArguments(output_dir="trainer_output")
        _refuse_arguments(model=model, model_init=model_init, train_dataset=train_dataset,
                          compute_loss_func=compute_loss_func, optimizers=optimizers,
                          optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                          processing_class=processing_class, tokenizer=tokenizer)
        self.model = model if model is not None else model_init()  # type: ignore[misc]
        self.model_init = model_init
        self.processing_class = processing_class if processing_class is not None else tokenizer
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.train_dataset, collate = _prepare_data(self.model, self.args, train_dataset,
                                                    data_collator or default_data_collator)
        self.data_collator = collate
        self.plan: TrainingPlan = plan_training(self.args, replicas=replicas,
                                                num_samples=len(self.train_dataset))
        self.eval_every = plan_evaluation(
            self.args, eval_dataset, compute_metrics, steps=self.plan.steps,
            steps_per_epoch=-(-len(self.train_dataset) // self.plan.global_batch_size))
        self.eval_dataset = None if eval_dataset is None else _prepare_data(
            self.model, self.args, eval_dataset, collate)[0]
        self.callbacks = list(callbacks or [])
        self.replicas, self.spares, self.chaos, self.policy = replicas, spares, chaos, policy
        self.checkpoint = checkpoint if checkpoint is not None else self.plan.checkpoint()
        self.run_dir = Path(run_dir) if run_dir is not None else (
            Path(str(self.args.output_dir)) / "planaria")
        self.options = options
        self.result: FitResult | None = None
        self.bridge: CallbackBridge | None = None

    @property
    def state(self) -> Any:
        """The ``TrainerState`` the callbacks see (None before ``train()``)."""
        return self.bridge.state if self.bridge is not None else None

    def spec(self) -> TrainSpec:
        """The planaria job this trainer runs."""
        plan = self.plan
        factory: Callable[[], nn.Module] = (
            ModelInit(model_init=self.model_init, use_cache=plan.use_cache)
            if self.model_init is not None
            else ModelFromWeights.capture(self.model, use_cache=plan.use_cache))
        return TrainSpec(
            model=factory, optimizer=plan.optimizer, optimizer_gets="model", loss=model_loss,
            dataset=DatasetSource(self.train_dataset), collate=self.data_collator,
            global_batch_size=plan.global_batch_size, micro_batch_size=plan.micro_batch_size,
            lr_scheduler=plan.scheduler, grad_clip_norm=plan.grad_clip_norm, seed=plan.seed,
            precision=plan.precision, compile=plan.compile, compile_options=plan.compile_options,
            name=type(self.model).__name__,
            eval_dataset=None if self.eval_dataset is None else DatasetSource(self.eval_dataset),
            evaluate=None if self.eval_dataset is None else eval_loss,
            eval_batch_size=self.args.per_device_eval_batch_size,
        )

    def train(self, resume_from_checkpoint: bool | None = None) -> TrainOutput:
        """Trains to the planned steps, saves the final model (and the processing class) to
        ``args.output_dir`` and returns Trainer's ``TrainOutput``. planaria resumes from its
        own checkpoints (``CheckpointConfig.resume``); a Trainer checkpoint path is refused."""
        if resume_from_checkpoint not in (None, True, False):
            raise ConfigError(
                f"resume_from_checkpoint={resume_from_checkpoint!r} is not valid: "
                "ElasticTrainer resumes from planaria's checkpoints (in run_dir, by default), "
                "not from a Trainer checkpoint folder"
            )
        checkpoint = self.checkpoint
        if resume_from_checkpoint is False and checkpoint is not None:
            checkpoint = dataclasses.replace(checkpoint, resume=False)
        self.bridge = CallbackBridge(self.callbacks, args=self.args, plan=self.plan,
                                     num_samples=len(self.train_dataset),
                                     processing_class=self.processing_class)
        self.bridge.call("on_train_begin")
        self.result = fit(
            self.spec(), steps=self.plan.steps, replicas=self.replicas, run_dir=self.run_dir,
            spares=self.spares, chaos=self.chaos, checkpoint=checkpoint, policy=self.policy,
            listeners=[self.bridge], eval_every=self.eval_every,
            loggers=report_trackers(self.args),
            tracker_options=TrackerOptions(
                log_dir=(Path(str(getattr(self.args, "logging_dir", None)))  # transformers 4
                         if getattr(self.args, "logging_dir", None) else None),
                run_name=self.args.run_name),
            **self.options,
        )
        self.model.load_state_dict(self.result.state_dict)
        self.save_model()
        self.bridge.call("on_train_end")
        losses = self.result.losses.values
        mean = float(sum(losses) / len(losses)) if len(losses) else float("nan")
        return TrainOutput(self.result.final_step, mean, {"train_loss": mean})

    def save_model(self, output_dir: str | None = None) -> None:
        """``save_pretrained`` of the model (and of the processing class, if given)."""
        where = output_dir or self.args.output_dir
        self.model.save_pretrained(where)  # type: ignore[operator]
        if self.processing_class is not None:
            self.processing_class.save_pretrained(where)


def _refuse_arguments(*, model: Any, model_init: Any, train_dataset: Any, compute_loss_func: Any,
                      optimizers: Any, optimizer_cls_and_kwargs: Any, processing_class: Any,
                      tokenizer: Any) -> None:
    """Trainer's arguments planaria cannot take, by name."""
    if (model is None) == (model_init is None):
        raise ConfigError("ElasticTrainer needs exactly one of model and model_init")
    if train_dataset is None:
        raise ConfigError("train_dataset=None is not valid: ElasticTrainer needs a map-style "
                          "dataset (a datasets.Dataset, or __len__ and __getitem__)")
    if not hasattr(train_dataset, "__len__") or not hasattr(train_dataset, "__getitem__"):
        raise ConfigError(
            f"train_dataset={type(train_dataset).__name__} is not valid: planaria's data plan "
            "needs a map-style dataset (__len__ and __getitem__; exactly-once needs an index), "
            "not an iterable one; use a datasets.Dataset or a map-style view of your data"
        )
    for name, value, why in (
        ("compute_loss_func", compute_loss_func, "the loss is the model's own "
                                                 "(model(**batch).loss)"),
        ("optimizer_cls_and_kwargs", optimizer_cls_and_kwargs, "the optimizer is AdamW "
                                                               "from TrainingArguments"),
    ):
        if value is not None:
            raise ConfigError(f"{name} is not valid with ElasticTrainer: {why}")
    if tuple(optimizers) != (None, None):
        raise ConfigError("optimizers=(optimizer, scheduler) is not valid with ElasticTrainer: "
                          "built objects cannot be rebuilt in each worker; the optimizer and "
                          "the scheduler come from TrainingArguments")
    if processing_class is not None and tokenizer is not None:
        raise ConfigError("give processing_class or tokenizer, not both")


def _prepare_data(model: nn.Module, args: Any, dataset: Any,
                  collate: Callable[[list[Any]], Any]) -> tuple[Any, Callable[[list[Any]], Any]]:
    """Trainer's ``_remove_unused_columns``: a ``datasets.Dataset`` loses the columns
    ``model.forward`` does not take; other datasets' dict samples lose them in the collator."""
    if not args.remove_unused_columns:
        return dataset, collate
    keep = set(inspect.signature(model.forward).parameters) | set(_LABEL_COLUMNS)
    keep |= set(args.label_names or [])
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list) and hasattr(dataset, "remove_columns"):
        unused = [c for c in columns if c not in keep]
        if unused:
            _log.info("ElasticTrainer: the columns %s are not taken by %s.forward: removed",
                      ", ".join(unused), type(model).__name__)
            dataset = dataset.remove_columns(unused)
        return dataset, collate
    return dataset, ColumnFilter.around(collate, keep)
