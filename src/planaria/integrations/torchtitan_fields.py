"""Every field of a torchtitan ``Trainer.Config``: honoured, harmless, or refused by name.

A field left at its default (its section's ``Config()``) is never a question. A field set to
anything else must be in :data:`HONOURED` (planaria maps it: see
:mod:`planaria.integrations.torchtitan`), in :data:`HARMLESS` (it changes nothing planaria
computes, or is used only by a feature that is off), or in :data:`ACCEPTED` with one of the
values listed there; any other field is refused with its reason, :data:`REFUSED`'s when it
has one. A field a later torchtitan adds is in no table, so it is refused until someone
decides what it means here: never ignored silently. A whole section named in a table (such
as ``"dataloader"``) covers its fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from planaria.faults.errors import ConfigError

__all__ = ["ACCEPTED", "HARMLESS", "HONOURED", "REFUSED", "refuse_unhonoured"]

HONOURED: dict[str, str] = {
    "model_spec": "the model: model_spec.model built on the meta device in training.dtype, "
                  "moved to the worker's device and initialised by its init_weights(), as "
                  "torchtitan's Trainer does (its parallelize_fn is not run: see parallelism)",
    "loss": "the loss of each micro-batch, built from the config (a ChunkedLossWrapper given "
            "the model's lm_head), the summed loss divided by the step's valid tokens",
    "optimizer": "torchtitan's OptimizersContainer built from param_groups (regex patterns, "
                 "first match wins, each group's optimizer_kwargs) and implementation: its "
                 "one torch optimizer is planaria's",
    "lr_scheduler": "torchtitan's LRSchedulersContainer (warmup_steps, total_steps, "
                    "decay_ratio, decay_type, min_lr_factor) for training.steps; its LambdaLR "
                    "is stepped once per committed step",
    "training.local_batch_size": "micro_batch_size (the samples of one forward and backward)",
    "training.global_batch_size": "global_batch_size; -1: local_batch_size x replicas at "
                                  "start; kept constant whatever the width later",
    "training.seq_len": "the model's RoPE (update_from_config); give TokenWindows the same",
    "training.max_norm": "grad_clip_norm (the reduced gradient's global L2 norm)",
    "training.steps": "RunConfig.steps, and the scheduler's training steps",
    "training.dtype": "the dtype the model is built in",
    "debug.seed": "TrainSpec.seed: model init, data order, per-step randomness (None: 0)",
}

HARMLESS: dict[str, str] = {
    "hf_assets_path": "the tokenizer's files: the dataset given is tokens already",
    "tokenizer": "the dataset given is tokens already",
    "dataloader": "replaced by the map-style dataset given: planaria's plan batches and orders "
                  "it (exactly-once needs every sample's index; torchtitan's loaders stream)",
    "dump_folder": "planaria writes to its run_dir",
    "metrics": "planaria's step metrics, event log and trackers (fit(loggers=[...]))",
    "profiler": "not run; profile the workers with planaria's own tools",
    "comm": "planaria's own deadlines (RunConfig.join_timeout_s, collective_timeout_s)",
    "activation_checkpoint": "recomputes activations in the backward to save memory, the "
                             "same gradients; not applied (parallelize_fn is not run)",
    "training.disable_cuda_graphs": "planaria captures no CUDA graphs",
    "training.gc_freq": "Python's garbage collection is left as it is",
    "training.gc_debug": "Python's garbage collection is left as it is",
    "training.mixed_precision_param": "applied by torchtitan's FSDP only; a planaria replica "
                                      "is a whole copy (as torchtitan's without FSDP)",
    "training.mixed_precision_reduce": "applied by torchtitan's FSDP only",
    "parallelism.fsdp_reshard_after_forward": "FSDP only (data_parallel_shard_degree > 1)",
    "parallelism.enable_fsdp_symm_mem": "FSDP only (data_parallel_shard_degree > 1)",
    "parallelism.enable_sequence_parallel": "tensor parallelism only",
    "parallelism.spmd_backend": "tensor parallelism only",
    "parallelism.module_fqns_per_model_part": "pipeline parallelism only",
    "parallelism.pipeline_parallel_first_stage_less_layers": "pipeline parallelism only",
    "parallelism.pipeline_parallel_last_stage_less_layers": "pipeline parallelism only",
    "parallelism.pipeline_parallel_layers_per_stage": "pipeline parallelism only",
    "parallelism.pipeline_parallel_schedule": "pipeline parallelism only",
    "parallelism.pipeline_parallel_schedule_csv": "pipeline parallelism only",
    "parallelism.pipeline_parallel_microbatch_size": "pipeline parallelism only",
    "parallelism.context_parallel_load_balancer": "context parallelism only",
    "parallelism.context_parallel_ptrr_mask_key": "context parallelism only",
    "compile.components": "used only with compile.enable",
    "compile.backend": "used only with compile.enable",
    "compile.enable_async_tensor_parallel": "tensor parallelism only",
    "validator.freq": "used only with validator.enable",
    "validator.steps": "used only with validator.enable",
    "validator.dataloader": "used only with validator.enable",
    "debug.spmd_typechecking": "tensor parallelism only",
    "debug.print_config": "logging only",
    "debug.save_config_file": "logging only",
    "debug.enable_structured_logging": "logging only",
    **{f"checkpoint.{name}": "used only with checkpoint.enable" for name in (
        "folder", "interval", "initial_load_model_only", "initial_load_in_hf",
        "initial_load_in_hf_quantized", "last_save_model_only", "last_save_in_hf",
        "export_dtype", "keep_latest_k", "load_step", "exclude_from_loading",
        "enable_first_step_checkpoint", "async_mode")},
}

_WIDTH = ("planaria's width is RunConfig.replicas (whole replicas, data parallel, resized "
          "with the global batch kept); a torchtitan degree assumes a fixed world")
ACCEPTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "parallelism.data_parallel_shard_degree": (
        (-1, 1), "FSDP inside a replica is not mapped from torchtitan (its parallelize_fn "
        "is not run): use -1 or 1, and planaria's RunConfig(workers_per_replica=k) for "
        "sharded replicas; " + _WIDTH),
    "parallelism.data_parallel_replicate_degree": ((1,), _WIDTH),
}

REFUSED: dict[str, str] = {
    "parallelism.tensor_parallel_degree": "tensor parallelism is not supported: a planaria "
                                          "replica is whole, or sharded with FSDP2",
    "parallelism.pipeline_parallel_degree": "pipeline parallelism is not supported: a planaria "
                                            "replica runs the whole model",
    "parallelism.context_parallel_degree": "context parallelism is not supported",
    "parallelism.expert_parallel_degree": "expert parallelism is not supported",
    "compile.enable": "torchtitan compiles each block in its parallelize_fn, which planaria "
                      "does not run; set it False (planaria's TrainSpec.compile compiles the "
                      "whole model)",
    "checkpoint.enable": "planaria checkpoints the job itself (sharded, asynchronous, "
                         "restored at any width): fit(checkpoint=CheckpointConfig(...))",
    "checkpoint.initial_load_path": "not loaded: planaria starts from the model's "
                                    "init_weights, or resumes from its own checkpoint",
    "checkpoint.create_seed_checkpoint": "planaria checkpoints the job itself",
    "checkpoint.load_only": "planaria checkpoints the job itself",
    "validator.enable": "torchtitan's validator is not mapped: evaluate with planaria's "
                        "TrainSpec(eval_dataset=..., evaluate=...) and RunConfig.eval_every",
    "training.enable_cpu_offload": "planaria keeps the model on the worker's device",
    "debug.deterministic": "not applied in the workers: call "
                           "torch.use_deterministic_algorithms in your own model factory",
    "debug.deterministic_warn_only": "not applied in the workers",
    "debug.detect_anomaly": "not applied in the workers",
    "debug.batch_invariant": "not applied in the workers",
    "debug.moe_force_load_balance": "not applied: MoE routing options are not mapped",
    "override.imports": "torchtitan's config overrides are not applied: apply them to the "
                        "config before handing it over",
}


def _in_table(name: str, table: dict[str, Any]) -> bool:
    return name in table or name.split(".", 1)[0] in table


def _section_defaults(section: Any) -> Any:
    try:
        return type(section)()
    except TypeError:  # a section with required fields: every field is a question
        return None


def refuse_unhonoured(config: Any) -> None:
    """Raises :class:`ConfigError` naming every field of ``config`` (a torchtitan
    ``Trainer.Config``) that is set, is neither honoured nor harmless, and holds no accepted
    value, each with its reason."""
    refused = []
    for top in dataclasses.fields(config):
        section = getattr(config, top.name)
        if _in_table(top.name, HONOURED) or _in_table(top.name, HARMLESS):
            continue
        if not dataclasses.is_dataclass(section):  # a plain field at the top
            refused.append(f"{top.name}={section!r}: {REFUSED.get(top.name, 'not mapped')}")
            continue
        defaults = _section_defaults(section)
        for sub in dataclasses.fields(section):
            name, value = f"{top.name}.{sub.name}", getattr(section, sub.name)
            if name in HONOURED or name in HARMLESS:
                continue
            if name in ACCEPTED:
                accepted, reason = ACCEPTED[name]
                if value not in accepted:
                    refused.append(f"{name}={value!r}: {reason}")
                continue
            if defaults is not None and value == getattr(defaults, sub.name):
                continue
            refused.append(f"{name}={value!r}: "
                           f"{REFUSED.get(name, 'not mapped to planaria (no table has it)')}")
    if refused:
        raise ConfigError("torchtitan config fields planaria cannot honour: "
                          + "; ".join(refused))
