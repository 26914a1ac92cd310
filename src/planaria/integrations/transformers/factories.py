"""The TrainSpec's factories for a Hugging Face job, as picklable objects that run in the
workers: the model (from ``model_init`` or from a given model's class, config and weights),
Trainer's AdamW with its no-decay groups, ``get_scheduler``, the model's own loss, the
dataset and the collator."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "AdamWFactory",
    "ColumnFilter",
    "DatasetSource",
    "ModelFromWeights",
    "ModelInit",
    "SchedulerFactory",
    "decay_parameter_names",
    "eval_loss",
    "model_loss",
]


@dataclass(frozen=True, kw_only=True)
class ModelFromWeights:
    """Builds ``model_class(config)`` and loads the weights captured (once, on the CPU) from
    the model given to the trainer: what crosses the wire is the class (by reference), the
    config and one copy of the weights."""

    model_class: type
    config: Any
    state: Mapping[str, torch.Tensor] = field(repr=False)
    dtype: torch.dtype
    use_cache: bool | None = None

    @classmethod
    def capture(cls, model: nn.Module, *, use_cache: bool | None) -> ModelFromWeights:
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        return cls(model_class=type(model), config=model.config, state=state, dtype=dtype,
                   use_cache=use_cache)

    def __call__(self) -> nn.Module:
        model = self.model_class(self.config).to(self.dtype)
        model.load_state_dict(self.state)
        _set_use_cache(model, self.use_cache)
        return model


@dataclass(frozen=True, kw_only=True)
class ModelInit:
    """Calls the user's ``model_init`` (with the worker's generators seeded from the seed)."""

    model_init: Callable[[], nn.Module]
    use_cache: bool | None = None

    def __call__(self) -> nn.Module:
        model = self.model_init()
        _set_use_cache(model, self.use_cache)
        return model


def _set_use_cache(model: nn.Module, use_cache: bool | None) -> None:
    config = getattr(model, "config", None)
    if use_cache is not None and config is not None and hasattr(config, "use_cache"):
        config.use_cache = use_cache  # as Trainer does (TrainingArguments.use_cache)


def decay_parameter_names(model: nn.Module) -> list[str]:
    """The names of the parameters Trainer applies weight decay to: Trainer's own rule (no
    decay for biases and norm layers), called from Trainer so that it is the installed
    version's (it reads nothing of the trainer)."""
    from transformers import Trainer

    return list(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class AdamWFactory:
    """Trainer's ``create_optimizer`` for ``optim='adamw_torch'`` / ``'adamw_torch_fused'``:
    a decay group and a no-decay group (weight decay 0), in ``named_parameters`` order."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    fused: bool = False

    def __call__(self, model: nn.Module) -> torch.optim.Optimizer:
        decay = set(decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        options: dict[str, Any] = {"lr": self.lr, "betas": self.betas, "eps": self.eps}
        if self.fused:
            options["fused"] = True
        return torch.optim.AdamW(groups, **options)


@dataclass(frozen=True, kw_only=True)
class SchedulerFactory:
    """``transformers.get_scheduler`` as Trainer's ``create_scheduler`` calls it."""

    name: str
    warmup_steps: int
    training_steps: int
    kwargs: Mapping[str, Any] | None = None

    def __call__(self, optimizer: torch.optim.Optimizer) -> Any:
        from transformers import get_scheduler

        return get_scheduler(self.name, optimizer=optimizer, num_warmup_steps=self.warmup_steps,
                             num_training_steps=self.training_steps,
                             scheduler_specific_kwargs=dict(self.kwargs or {}))

    def learning_rates(self, lr: float, steps: int) -> list[float]:
        """The learning rate each step ``0..steps-1`` trains with (what Trainer logs)."""
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
        scheduler = self(optimizer)
        rates = []
        for _ in range(steps):
            rates.append(float(scheduler.get_last_lr()[0]))
            optimizer.step()
            scheduler.step()
        return rates


def model_loss(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The model's own loss, as Trainer's ``compute_loss``: ``model(**batch).loss``."""
    outputs = model(**batch)
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs[0]
    if loss is None:
        keys = ", ".join(outputs.keys()) if isinstance(outputs, Mapping) else type(outputs)
        raise ValueError(
            f"the model did not return a loss from the inputs, only {keys}; the batch has "
            f"{', '.join(batch)}: give it labels (a data_collator that adds them, or a "
            "'labels' column)"
        )
    return loss


@dataclass(frozen=True)
class DatasetSource:
    """Hands the (already prepared) dataset to the workers."""

    dataset: Any = field(repr=False)

    def __call__(self) -> Any:
        return self.dataset


@dataclass(frozen=True, kw_only=True)
class ColumnFilter:
    """Trainer's ``RemoveColumnsCollator``: drops the keys of dict samples that
    ``model.forward`` does not take, then collates."""

    collate: Callable[[list[Any]], Any]
    keep: frozenset[str]

    @classmethod
    def around(cls, collate: Callable[[list[Any]], Any], keep: Iterable[str]) -> ColumnFilter:
        return cls(collate=collate, keep=frozenset(keep))

    def __call__(self, samples: list[Any]) -> Any:
        if samples and isinstance(samples[0], Mapping):
            samples = [{k: v for k, v in s.items() if k in self.keep} for s in samples]
        return self.collate(samples)


def eval_loss(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The evaluation's figure of a batch, as Trainer's ``evaluate``: the model's own loss
    (reported as ``eval_loss``)."""
    return {"loss": model_loss(model, batch)}
