"""A torchtitan job trained elastic: its ``Trainer.Config`` (model, loss, optimizer, LR
schedule, batch sizes, steps, clipping, seed) and a map-style token dataset as a planaria
:class:`~planaria.TrainSpec`, run with :func:`~planaria.fit`.

Needs torchtitan 0.3 (``pip install "planaria[torchtitan]"``)::

    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from planaria.integrations.torchtitan import TokenWindows, fit_torchtitan

    config = llama3_debugmodel()
    result = fit_torchtitan(config, lambda: TokenWindows(tokens, config.training.seq_len),
                            replicas=3, run_dir="runs/titan", chaos="kill:w1@step5")

What maps (every field is in a table of :mod:`planaria.integrations.torchtitan_fields`:
honoured, harmless, or refused by name with the reason):

- The model: ``model_spec.model`` (the flavor's config, after ``update_from_config`` with
  the job's config, as the Trainer calls it) built on the meta device in
  ``training.dtype``, moved to the worker's device empty and initialised by the model's own
  ``init_weights()``, from torch's generator seeded from ``debug.seed`` (None: 0) in every
  worker. torchtitan's ``parallelize_fn`` is not run: tensor, pipeline, context and expert
  parallel degrees above 1 are refused, and so is an FSDP degree
  (``data_parallel_shard_degree`` other than -1 or 1): planaria's replicas are data
  parallel, and their number is ``replicas``. Quantized linears (float8, MX, NVFP4) and a
  ``post_optimizer_build_fn`` are refused.
- The loss: the config's loss (``CrossEntropyLoss``, or a ``ChunkedLossWrapper`` around
  it, given the model's ``lm_head`` as the Trainer gives it), on the model's output for
  ``input_dict["input"]`` (the dict's other keys, such as ``positions``, are the forward's
  keyword arguments, with the attention masks built from the positions for flex and varlen
  attention). The summed loss is divided by the step's valid tokens (labels other than
  -100) as in torchtitan, exactly when every sample has as many valid labels (each micro-
  batch is weighted by its samples; :class:`TokenWindows`' samples have ``seq_len`` each).
- The optimizer: torchtitan's own ``OptimizersContainer`` built from ``optimizer``
  (``default_adamw``: AdamW, lr 8e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on
  every parameter, fused; ``param_groups`` with regex patterns for no-decay groups), its
  one torch optimizer planaria's; several optimizer types, Muon and bf16 optimizer states
  are refused. The schedule: torchtitan's ``LRSchedulersContainer`` (linear warm-up, a
  stable phase for ``decay_ratio``, linear / sqrt / cosine decay to ``min_lr_factor``)
  for ``training.steps`` (or ``lr_scheduler.total_steps``), stepped once a committed step.
- The step: ``training.local_batch_size`` is the micro-batch, ``training.global_batch_size``
  the global batch (-1: ``local_batch_size`` x replicas at start, as torchtitan's at that
  width), constant across resizes; ``training.max_norm`` clips the reduced gradient's
  norm; ``training.steps`` is the job's steps.
- The data: torchtitan's loaders stream (an ``IterableDataset``), and exactly-once needs
  every sample's index, so ``dataloader`` and ``tokenizer`` are replaced by the dataset
  given: map-style, each sample ``(input_dict, labels)`` as torchtitan's loader yields it
  (:class:`TokenWindows` cuts a token array so).
- Refused by name: ``compile.enable``, ``checkpoint.enable`` (planaria checkpoints the job:
  ``fit(checkpoint=...)``), ``validator.enable``, ``training.enable_cpu_offload``, the
  ``debug`` switches planaria does not apply, ``override.imports``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planaria.config import TrainSpec
from planaria.faults.errors import ConfigError
from planaria.fit import FitResult, fit
from planaria.integrations.torchtitan_fields import refuse_unhonoured
from planaria.integrations.torchtitan_parts import (
    TitanModel,
    TitanOptimizer,
    TitanScheduler,
    TitanStep,
    TokenWindows,
    build_titan_model,
    check_loss,
    check_model,
)

__all__ = ["TitanJob", "TokenWindows", "build_titan_model", "fit_torchtitan",
           "spec_from_torchtitan"]

OPTIMIZERS = ("Adam", "AdamW")


@dataclass(frozen=True, kw_only=True)
class TitanJob:
    """What a torchtitan config maps to: the spec, and the ``RunConfig`` fields it implies
    beyond the spec's (``steps``; the global batch, seed and clipping are the spec's)."""

    spec: TrainSpec
    steps: int


def check_optimizer(optimizer: Any) -> None:
    names = {group.optimizer_name for group in optimizer.param_groups}
    if len(names) != 1 or not names <= set(OPTIMIZERS):
        raise ConfigError(
            f"optimizer.param_groups with optimizer_name {sorted(names)} is refused: planaria "
            f"steps one torch optimizer, {' or '.join(OPTIMIZERS)} (Muon needs torchtitan's "
            "distributed optimizer); give every group the same one")
    if optimizer.implementation == "fused_opt_states_bf16":
        raise ConfigError(
            "optimizer.implementation='fused_opt_states_bf16' is refused: its bf16 states "
            "come from a hook on torchtitan's container; use 'fused', 'foreach' or 'for-loop'")
    if optimizer.optimizer_factory_kwargs_by_name:
        raise ConfigError(
            "optimizer.optimizer_factory_kwargs_by_name is refused: its objects (compute "
            "metadata, communication buckets) are for torchtitan's distributed optimizers")


def global_batch(training: Any, replicas: int) -> int:
    """``training.global_batch_size``, or (-1) ``local_batch_size`` x ``replicas``."""
    size = training.global_batch_size
    if size < 0:
        size = training.local_batch_size * replicas
    if size % training.local_batch_size:
        raise ConfigError(
            f"training.global_batch_size={size} is not valid: a multiple of "
            f"training.local_batch_size={training.local_batch_size}")
    return int(size)


def spec_from_torchtitan(config: Any, dataset: Callable[[], Any], *, replicas: int,
                         name: str | None = None) -> TitanJob:
    """The :class:`TitanJob` that trains ``config`` (a torchtitan ``Trainer.Config``, such
    as ``llama3_debugmodel()``) on ``dataset`` (a factory of a map-style dataset whose
    samples are ``(input_dict, labels)``, such as :class:`TokenWindows`), at ``replicas``
    replicas at start (the global batch, when ``training.global_batch_size`` is -1); see
    the module's docstring for what maps. Refuses what planaria cannot honour, by name."""
    if not callable(dataset) or isinstance(dataset, TokenWindows):
        raise ConfigError(
            f"dataset={type(dataset).__name__} is not valid: give a factory (a function "
            "returning the dataset), so that each worker builds its own")
    refuse_unhonoured(config)
    model_spec, training = config.model_spec, config.training
    check_model(model_spec)
    check_loss(config.loss)
    check_optimizer(config.optimizer)
    if training.max_norm <= 0:
        raise ConfigError(f"training.max_norm={training.max_norm} is not valid: a norm > 0 "
                          "(torchtitan clips at every step)")
    model_config = model_spec.model
    model_config.update_from_config(config=config)  # as the Trainer: RoPE for seq_len
    size = global_batch(training, replicas)
    seed = config.debug.seed if config.debug.seed is not None else 0
    spec = TrainSpec(
        model=TitanModel(model_config=model_config, dtype=training.dtype),
        optimizer=TitanOptimizer(optimizer_config=config.optimizer),
        optimizer_gets="model",
        lr_scheduler=TitanScheduler(scheduler_config=config.lr_scheduler,
                                    training_steps=training.steps),
        forward_backward=TitanStep(config.loss, global_batch_size=size),
        dataset=dataset,
        global_batch_size=size,
        micro_batch_size=training.local_batch_size,
        grad_clip_norm=float(training.max_norm),
        seed=int(seed),
        name=name or f"{model_spec.name}-{model_spec.flavor}",
    )
    return TitanJob(spec=spec, steps=int(training.steps))


def fit_torchtitan(config: Any, dataset: Callable[[], Any], *, replicas: int,
                   run_dir: str | Path, **fit_options: Any) -> FitResult:
    """Trains a torchtitan job elastic: :func:`spec_from_torchtitan`, run with
    :func:`~planaria.fit` for ``training.steps`` (``fit_options``: its keyword arguments,
    such as ``chaos``, ``policy``, ``checkpoint``, ``spares``). Returns fit's
    :class:`~planaria.FitResult`; its ``state_dict`` is the model's."""
    job = spec_from_torchtitan(config, dataset, replicas=replicas)
    return fit(job.spec, steps=job.steps, replicas=replicas, run_dir=run_dir, **fit_options)
