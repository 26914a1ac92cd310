"""``TrainerCallback`` hooks on the controller, from planaria's events.

Which hooks fire, and when:

- ``on_train_begin``: once, before the workers start;
- ``on_step_end``: after each committed step (``state.global_step`` = steps done; a step
  trained again after a restore from a checkpoint fires again);
- ``on_log``: every ``logging_steps`` committed steps (and after the first with
  ``logging_first_step``), with ``loss`` (the mean since the last log), ``learning_rate``
  (the rate the step trained with) and ``epoch``; planaria's events carry no gradient norm,
  so there is no ``grad_norm``;
- ``on_evaluate`` (after an ``on_log`` of the same figures): after each evaluation
  (``eval_strategy``), with ``eval_loss`` and ``eval_runtime``;
- ``on_save``: after each checkpoint planaria commits;
- ``on_train_end``: once, after the final model is saved.

No other hook fires (no ``on_step_begin``, ``on_substep_end``, ``on_*_optimizer_step``,
``on_epoch_*``: they belong to the workers' steps). Hooks get
``model=None``, ``optimizer=None`` and ``lr_scheduler=None`` (they live in the workers) and
the ``processing_class``. ``TrainerControl``'s flags are not acted on: a callback that asks
``should_training_stop`` is logged, not obeyed. A callback that raises is logged and
training goes on (a display must not stop a run).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from transformers import TrainerControl, TrainerState

from planaria.integrations.transformers.arguments import TrainingPlan

__all__ = ["CallbackBridge"]

_log = logging.getLogger(__name__)


class CallbackBridge:
    """Calls the trainer's callbacks from planaria's event records (:meth:`__call__` is a
    ``fit`` listener)."""

    def __init__(self, callbacks: Sequence[Any], *, args: Any, plan: TrainingPlan,
                 num_samples: int, processing_class: Any = None) -> None:
        self.callbacks = [cb() if isinstance(cb, type) else cb for cb in callbacks]
        self.args = args
        self.plan = plan
        self.num_samples = num_samples
        self.processing_class = processing_class
        self.state = TrainerState(max_steps=plan.steps, logging_steps=plan.logging_steps or 0,
                                  save_steps=plan.save_every or 0,
                                  train_batch_size=plan.global_batch_size,
                                  num_train_epochs=_epochs(plan, num_samples))
        self.control = TrainerControl()
        self._rates = plan.scheduler.learning_rates(plan.learning_rate, plan.steps)
        self._losses: list[float] = []  # since the last log
        self._lock = threading.Lock()  # checkpoint events may come from another thread
        self._stop_noted = False

    def __call__(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event == "step_committed":
            with self._lock:
                self._step_committed(int(record["step"]), float(record["loss"]))
        elif event == "eval":
            with self._lock:
                metrics = {f"eval_{k}": float(v) for k, v in record["metrics"].items()}
                metrics["eval_runtime"] = float(record["seconds"])
                metrics["epoch"] = self.state.epoch
                self.state.log_history.append({**metrics, "step": int(record["step"])})
                self.call("on_log", logs=metrics)
                self.call("on_evaluate", metrics=metrics)
        elif event == "checkpoint_saved":
            with self._lock:
                # on_save sees the step saved; a save committed late (its write runs in the
                # background) must not take the training's step back for the hooks after it.
                now = self.state.global_step
                self.state.global_step = int(record["step"])
                self.call("on_save")
                self.state.global_step = max(now, self.state.global_step)

    def _step_committed(self, step: int, loss: float) -> None:
        done = step + 1
        self.state.global_step = done
        self.state.epoch = done * self.plan.global_batch_size / self.num_samples
        self.call("on_step_end")
        self._losses.append(loss)
        every = self.plan.logging_steps
        first = done == 1 and self.plan.logging_first_step
        if every is not None and (done % every == 0 or first):
            logs = {"loss": sum(self._losses) / len(self._losses),
                    "learning_rate": self._rates[min(step, len(self._rates) - 1)],
                    "epoch": self.state.epoch}
            self._losses.clear()
            self.state.log_history.append({**logs, "step": done})
            self.call("on_log", logs=logs)

    def call(self, hook: str, **kwargs: Any) -> None:
        """Calls ``hook`` on every callback, in order, as Trainer's CallbackHandler does."""
        for callback in self.callbacks:
            result = getattr(callback, hook)(
                self.args, self.state, self.control, model=None,
                processing_class=self.processing_class, optimizer=None, lr_scheduler=None,
                train_dataloader=None, eval_dataloader=None, **kwargs)
            if result is not None:
                self.control = result
        if self.control.should_training_stop and not self._stop_noted:
            self._stop_noted = True
            _log.warning("a callback set should_training_stop at step %d: ElasticTrainer "
                         "does not stop early; it trains its %d steps", self.state.global_step,
                         self.plan.steps)


def _epochs(plan: TrainingPlan, num_samples: int) -> int:
    return max(1, -(-plan.steps * plan.global_batch_size // num_samples))
