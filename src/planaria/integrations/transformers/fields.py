"""Every ``TrainingArguments`` field: honoured, harmless, or refused by name.

A field left at its default is never a question. A field set to anything else must be in
:data:`HONOURED` (planaria maps it: see :mod:`planaria.integrations.transformers.arguments`)
or in :data:`HARMLESS` (it changes nothing planaria computes: output and logging cosmetics,
options for evaluation while evaluation is off); any other field is refused with its reason,
:data:`REFUSED`'s when it has one. A field a later ``transformers`` adds is in no table, so
it is refused until someone decides what it means here: never ignored silently.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from planaria.faults.errors import ConfigError

__all__ = ["HARMLESS", "HONOURED", "REFUSED", "refuse_unhonoured"]

HONOURED: dict[str, str] = {
    "output_dir": "the final model (save_pretrained) and, by default, run_dir=output_dir/planaria",
    "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "global_batch_size = per_device_train_batch_size x "
                                   "gradient_accumulation_steps x replicas at start",
    "num_train_epochs": "steps = ceil(epochs x len(train_dataset) / global_batch_size) "
                        "when max_steps <= 0",
    "max_steps": "steps",
    "learning_rate": "AdamW's lr",
    "lr_scheduler_type": "transformers.get_scheduler(..., num_training_steps=steps), "
                         "stepped once a committed step",
    "lr_scheduler_kwargs": "get_scheduler's scheduler_specific_kwargs",
    "warmup_steps": "get_scheduler's num_warmup_steps (a float < 1: a ratio of steps)",
    "warmup_ratio": "get_scheduler's num_warmup_steps = ceil(ratio x steps) (transformers 4)",
    "optim": "torch.optim.AdamW ('adamw_torch'; fused=True for 'adamw_torch_fused')",
    "weight_decay": "AdamW weight decay, with Trainer's own no-decay groups",
    "adam_beta1": "AdamW betas[0]",
    "adam_beta2": "AdamW betas[1]",
    "adam_epsilon": "AdamW eps",
    "max_grad_norm": "grad_clip_norm (0 or None: no clipping)",
    "bf16": "precision='bf16'",
    "fp16": "precision='fp16'",
    "seed": "TrainSpec.seed (model init, data order, per-step randomness)",
    "logging_strategy": "'steps' or 'no': when callbacks get on_log",
    "logging_steps": "on_log every this many steps (a float < 1: a ratio of steps)",
    "logging_first_step": "on_log after the first step too",
    "save_strategy": "'steps': CheckpointConfig(every=save_steps); 'no': no periodic save",
    "save_steps": "CheckpointConfig.every (a float < 1: a ratio of steps)",
    "save_total_limit": "CheckpointConfig.keep_last",
    "report_to": "'tensorboard', 'wandb', 'mlflow' (or 'all'): planaria's trackers, fed "
                 "from the controller's events (fit(loggers=...)); 'none' or []: none",
    "logging_dir": "the trackers' folder (TrackerOptions.log_dir; transformers 4)",
    "run_name": "the run's name in W&B and MLflow",
    "eval_strategy": "'steps' or 'epoch': RunConfig.eval_every (planaria's evaluation)",
    "evaluation_strategy": "transformers 4's name of eval_strategy",
    "eval_steps": "RunConfig.eval_every with eval_strategy='steps' (a float < 1: a ratio)",
    "per_device_eval_batch_size": "TrainSpec.eval_batch_size (the eval set's batches, "
                                  "split over the live replicas)",
    "remove_unused_columns": "drops the columns model.forward does not take, as Trainer does",
    "use_cache": "model.config.use_cache, as Trainer sets it",
    "use_cpu": "True is planaria's default (RunConfig(use_gpu=False))",
    "torch_compile": "TrainSpec.compile",
    "torch_compile_backend": "TrainSpec.compile_options['backend']",
    "torch_compile_mode": "TrainSpec.compile_options['mode']",
    "average_tokens_across_devices": "planaria's gradient is the global batch's mean of "
                                     "micro-batch means: the token mean when every sequence "
                                     "has the same number of labelled tokens",
}
"""Fields planaria maps, and to what."""

_EVALUATION_OFF = ("evaluation options planaria's evaluation does not take (it reduces "
                   "each batch's eval loss over the live replicas)")
_HUB_OFF = "only used by push_to_hub, which is refused"
_TRACKERS_OFF = "only used by report_to='trackio', which is refused"

HARMLESS: dict[str, str] = {
    "overwrite_output_dir": "output cosmetics: the final save overwrites output_dir's files",
    "logging_nan_inf_filter": "logging cosmetics: only the loss Trainer logs",
    "log_level": "logging cosmetics: Trainer's console verbosity",
    "log_level_replica": "logging cosmetics: Trainer's console verbosity",
    "log_on_each_node": "logging cosmetics: Trainer's console verbosity",
    "disable_tqdm": "logging cosmetics: Trainer's progress bar (planaria has its own display)",
    "project": "logging cosmetics: a trackers' label (report_to is refused)",
    "skip_memory_metrics": "logging cosmetics: Trainer's memory report",
    "include_num_input_tokens_seen": "logging cosmetics: a figure in Trainer's logs",
    "include_tokens_per_second": "logging cosmetics: a figure in Trainer's logs",
    "do_train": "not used by Trainer (your script reads it)",
    "do_eval": "not used by Trainer (your script reads it)",
    "do_predict": "not used by Trainer (your script reads it)",
    "resume_from_checkpoint": "not used by Trainer (your script reads it); planaria resumes "
                              "from its own checkpoints (CheckpointConfig.resume)",
    "save_on_each_node": "planaria's checkpoints are sharded and committed once",
    "save_safetensors": "the final model is saved with save_pretrained's default",
    "dataloader_pin_memory": "a host-to-device copy speed-up; planaria loads its own batches",
    "eval_delay": _EVALUATION_OFF,
    "eval_accumulation_steps": _EVALUATION_OFF,
    "eval_do_concat_batches": _EVALUATION_OFF,
    "eval_use_gather_object": _EVALUATION_OFF,
    "prediction_loss_only": _EVALUATION_OFF,
    "include_for_metrics": _EVALUATION_OFF,
    "include_inputs_for_metrics": _EVALUATION_OFF,
    "batch_eval_metrics": _EVALUATION_OFF,
    "bf16_full_eval": _EVALUATION_OFF,
    "fp16_full_eval": _EVALUATION_OFF,
    "hub_token": _HUB_OFF,
    "hub_private_repo": _HUB_OFF,
    "hub_model_id": _HUB_OFF,
    "hub_strategy": _HUB_OFF,
    "hub_always_push": _HUB_OFF,
    "hub_revision": _HUB_OFF,
    "trackio_space_id": _TRACKERS_OFF,
    "trackio_bucket_id": _TRACKERS_OFF,
    "trackio_static_space_id": _TRACKERS_OFF,
}
"""Fields that change nothing planaria computes, and why."""

_LOADER = "planaria loads the samples itself (the data plan's exactly-once order)"
_OWN_REDUCTION = "planaria reduces the gradients itself (no DDP)"
_OWN_SHARDING = "planaria shards replicas itself (RunConfig(workers_per_replica=k))"
_CHECKPOINTING = ("not mapped yet: call model.gradient_checkpointing_enable() in "
                  "model_init")

REFUSED: dict[str, str] = {
    "optim_args": "planaria builds torch's AdamW from learning_rate, adam_beta1/2, "
                  "adam_epsilon and weight_decay only",
    "optim_target_modules": "only for optimizers planaria does not build (GaLore, APOLLO)",
    "label_smoothing_factor": "the loss is the model's own (model(**batch).loss)",
    "gradient_checkpointing": _CHECKPOINTING,
    "gradient_checkpointing_kwargs": _CHECKPOINTING,
    "activation_checkpointing": _CHECKPOINTING,
    "activation_checkpointing_kwargs": _CHECKPOINTING,
    "data_seed": "planaria's data order is drawn from seed alone (width-invariant)",
    "full_determinism": "not mapped: planaria's runs are width-invariant but do not switch "
                        "torch to deterministic algorithms",
    "dataloader_drop_last": "planaria never drops samples: a global batch may straddle two "
                            "epochs, every sample once per epoch",
    "dataloader_num_workers": _LOADER,
    "dataloader_prefetch_factor": _LOADER,
    "dataloader_persistent_workers": _LOADER,
    "group_by_length": _LOADER,
    "train_sampling_strategy": _LOADER,
    "auto_find_batch_size": "the global batch is fixed (it stays constant across resizes)",
    "eval_on_start": "not mapped yet: planaria evaluates after every eval_steps steps",
    "load_best_model_at_end": "the final model is the trained one; planaria keeps no best",
    "metric_for_best_model": "the final model is the trained one; planaria keeps no best",
    "push_to_hub": "planaria does not upload; push the saved output_dir yourself",
    "deepspeed": _OWN_SHARDING,
    "fsdp": _OWN_SHARDING,
    "fsdp_config": _OWN_SHARDING,
    "parallelism_config": _OWN_SHARDING,
    "accelerator_config": "planaria runs no Accelerator",
    "ddp_find_unused_parameters": _OWN_REDUCTION,
    "ddp_bucket_cap_mb": _OWN_REDUCTION + ": RunConfig(overlap_reduction=True) buckets it",
    "ddp_broadcast_buffers": _OWN_REDUCTION + " and buffers (BatchNorm's: reduced at commit)",
    "ddp_static_graph": _OWN_REDUCTION,
    "ddp_backend": _OWN_REDUCTION + ": RunConfig(backend=...)",
    "ddp_timeout": _OWN_REDUCTION + ": RunConfig(collective_timeout_s=...)",
    "dataloader_multiprocessing_context": _LOADER,
    "dataloader_in_order": _LOADER,
    "length_column_name": _LOADER,
    "ignore_data_skip": "planaria resumes at its data plan's position, never skipping",
    "save_only_model": "planaria's checkpoints hold the whole training state",
    "restore_callback_states_from_checkpoint": "callbacks' state is not checkpointed",
    "use_liger_kernel": "the model's forward is not patched",
    "liger_kernel_config": "the model's forward is not patched",
    "local_rank": "ElasticTrainer starts its own workers: do not launch it with torchrun",
    "neftune_noise_alpha": "the model's forward is not patched",
    "torch_empty_cache_steps": "not mapped",
    "tf32": "not mapped: set torch.backends in model_init",
}
"""Fields with a specific reason to refuse them; any field in no table is refused too."""


def refuse_unhonoured(args: Any) -> None:
    """Raises :class:`ConfigError` naming every field of ``args`` (a ``TrainingArguments``)
    that differs from its default and that planaria neither honours nor may ignore."""
    defaults = type(args)(output_dir=args.output_dir)
    refused = []
    for f in dataclasses.fields(args):
        if not f.init or f.name in HONOURED or f.name in HARMLESS:
            continue
        value, default = getattr(args, f.name, None), getattr(defaults, f.name, None)
        if _same(value, default):
            continue
        reason = REFUSED.get(f.name, "planaria does not honour it (yet)")
        refused.append(f"{f.name}={value!r} (default {default!r}): {reason}")
    if refused:
        raise ConfigError(
            "ElasticTrainer cannot honour these TrainingArguments: " + "; ".join(refused)
            + ". Leave them at their defaults"
        )


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values without a plain equality (tensors): compare their text
        return repr(a) == repr(b)
