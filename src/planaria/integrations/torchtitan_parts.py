"""The TrainSpec's factories for a torchtitan job, as picklable objects that run in the
workers: the model built and initialised as torchtitan's ``Trainer`` builds it, torchtitan's
own optimizer and LR scheduler builders, its loss over a micro-batch, and
:class:`TokenWindows`, a map-style view of a token stream."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from planaria.faults.errors import ConfigError

__all__ = ["TitanModel", "TitanOptimizer", "TitanScheduler", "TitanStep", "TokenWindows",
           "build_titan_model", "check_loss", "check_model"]

INSTALL = 'pip install "planaria[torchtitan]"'

try:
    from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.quantization.utils import has_quantization
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention
    from torchtitan.tools.utils import set_default_dtype
except ImportError as err:  # torchtitan, or one of the packages it imports (triton)
    raise ImportError(
        f"planaria.integrations.torchtitan needs torchtitan 0.3 ({err}): {INSTALL}") from err




class TokenWindows(Dataset[tuple[dict[str, torch.Tensor], torch.Tensor]]):
    """A 1-D token stream cut into windows of ``seq_len + 1`` tokens (window i starts at
    ``i * seq_len``), each sample as torchtitan's text loader yields it: ``({"input":
    tokens[:-1], "positions": 0..seq_len-1}, labels=tokens[1:])`` (one document per window).
    Map-style, so every sample has an index: the exactly-once plan can name it."""

    def __init__(self, tokens: Any, seq_len: int) -> None:
        self.tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        self.seq_len = int(seq_len)
        if self.seq_len < 1 or len(self.tokens) < self.seq_len + 1:
            raise ConfigError(
                f"TokenWindows(seq_len={seq_len}) is not valid for {len(self.tokens)} tokens: "
                "it needs seq_len >= 1 and at least seq_len + 1 tokens")
        self.positions = torch.arange(self.seq_len)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        window = self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1]
        return {"input": window[:-1], "positions": self.positions}, window[1:]


def build_titan_model(model_config: Any, *, dtype: str, device: torch.device | str = "cpu"
                      ) -> nn.Module:
    """The model as torchtitan's ``Trainer`` builds it without parallelisms: built on the meta
    device in ``dtype``, moved to ``device`` empty and initialised by its ``init_weights``
    under ``no_grad`` (drawing from torch's global generator), in training mode."""
    with torch.device("meta"), set_default_dtype(TORCH_DTYPE_MAP[dtype]):
        model = model_config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


@dataclass(frozen=True, kw_only=True)
class TitanModel:
    """``TrainSpec.model``: :func:`build_titan_model` on the CPU (planaria moves it)."""

    model_config: Any = field(repr=False)
    dtype: str = "float32"

    def __call__(self) -> nn.Module:
        return build_titan_model(self.model_config, dtype=self.dtype)


@dataclass(frozen=True, kw_only=True)
class TitanOptimizer:
    """``TrainSpec.optimizer`` (given the model): torchtitan's ``OptimizersContainer`` built
    from the config's param groups, and the one torch optimizer it holds (the groups, their
    regex patterns and kwargs, the fused / foreach implementation, exactly torchtitan's)."""

    optimizer_config: Any = field(repr=False)

    def __call__(self, model: nn.Module) -> torch.optim.Optimizer:
        container = self.optimizer_config.build(model_parts=[model])
        if len(container.optimizers) != 1:  # refused before the job starts; a safeguard
            raise ConfigError("optimizer.param_groups is not valid here: planaria steps one "
                              "torch optimizer; give every group the same optimizer_name")
        optimizer: torch.optim.Optimizer = container.optimizers[0]
        return optimizer


@dataclass(frozen=True, kw_only=True)
class TitanScheduler:
    """``TrainSpec.lr_scheduler``: torchtitan's ``LRSchedulersContainer`` built for
    ``training_steps`` (warm-up, stable phase, decay, ``min_lr_factor``), and its one
    ``LambdaLR``, stepped once per committed step as torchtitan steps it."""

    scheduler_config: Any = field(repr=False)
    training_steps: int

    def __call__(self, optimizer: torch.optim.Optimizer) -> Any:
        container = self.scheduler_config.build(optimizers=[optimizer],
                                                training_steps=self.training_steps)
        return container.schedulers[0]


class TitanStep:
    """``TrainSpec.forward_backward``: torchtitan's forward and loss of one micro-batch
    ``(input_dict, labels)``, as its ``Trainer`` runs them (the attention masks from the
    positions for flex and varlen attention; the loss config built once per model, a
    ``ChunkedLossWrapper`` given the model's ``lm_head``).

    torchtitan divides the summed loss by the valid tokens of the whole step; planaria
    weights each micro-batch by its share ``n / global_batch_size`` of the samples. The step
    passes the loss ``valid tokens x global_batch_size / n`` as that divisor: the step's
    valid tokens exactly when every sample has as many valid labels (``TokenWindows``: all
    of them), so the gradient is torchtitan's. The loss is pre-scaled so because a
    ``ChunkedLossWrapper`` runs its backward through the ``lm_head`` inside the call;
    ``backward`` is handed the loss divided by the share, which it multiplies back."""

    def __init__(self, loss_config: Any, *, global_batch_size: int) -> None:
        self.loss_config, self.global_batch_size = loss_config, global_batch_size
        self.losses: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict[str, Any]:
        return {"loss_config": self.loss_config, "global_batch_size": self.global_batch_size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["loss_config"],  # type: ignore[misc]
                      global_batch_size=state["global_batch_size"])

    def loss_for(self, model: Any) -> Any:
        """The loss built for ``model`` (once)."""
        loss_fn = self.losses.get(model)
        if loss_fn is None:
            loss_fn = self.loss_config.build(compile_config=None)
            if isinstance(loss_fn, ChunkedLossWrapper):
                loss_fn.set_lm_head(model.lm_head)
                model._skip_lm_head = True  # the model returns hidden states, as in torchtitan
            self.losses[model] = loss_fn
        return loss_fn

    def __call__(self, model: Any, batch: Any,
                 backward: Callable[..., None]) -> torch.Tensor:
        input_dict, labels = batch
        inputs = input_dict["input"]
        extra = {k: v for k, v in input_dict.items() if k != "input"}
        positions = extra.get("positions")
        if positions is not None and masked_attention(model):
            extra["attention_masks"] = model.get_attention_masks(positions=positions)
        loss_fn = self.loss_for(model)
        pred = model(inputs, **extra)
        n = labels.shape[0]
        valid = (labels != IGNORE_INDEX).sum()
        divisor = valid.to(torch.float64) * self.global_batch_size / n
        kwargs = {"positions": positions} if positions is not None else {}
        loss, _ = loss_fn(pred, labels, divisor.to(torch.float32), **kwargs)
        share = n / self.global_batch_size
        backward(loss / share)
        return (loss / share).detach()


def masked_attention(model: nn.Module) -> bool:
    """The model's attention takes masks built from positions (flex or varlen), as
    torchtitan's ``post_dataloading_process`` decides."""
    config = getattr(model, "config", None)
    attention = getattr(config, "first_attention", None)
    inner = getattr(attention, "inner_attention", None)
    return isinstance(inner, (FlexAttention.Config, VarlenAttention.Config))


def check_model(model_spec: Any) -> None:
    """Refuses a model planaria cannot build as torchtitan does."""
    if model_spec is None:
        raise ConfigError("model_spec=None is not valid: the config names no model")
    if has_quantization(model_spec.model):
        raise ConfigError(
            f"model_spec={model_spec.name}/{model_spec.flavor} is refused: its linears are "
            "quantized (float8, MX or NVFP4 converters), which torchtitan applies with its "
            "parallelize_fn and compile; planaria trains the model as built")
    if model_spec.post_optimizer_build_fn is not None:
        raise ConfigError(
            "model_spec.post_optimizer_build_fn is refused: it hooks torchtitan's optimizer "
            "container (MoE load balancing), which planaria does not step")


def check_loss(loss: Any) -> None:
    inner = loss.loss_fn if isinstance(loss, ChunkedLossWrapper.Config) else loss
    if type(inner) is not CrossEntropyLoss.Config:
        raise ConfigError(
            f"loss={type(loss).__qualname__}({type(inner).__qualname__}) is refused: planaria "
            "maps torchtitan's cross-entropy (CrossEntropyLoss, or a ChunkedLossWrapper "
            "around it)")
