"""Hugging Face ``transformers``: :class:`ElasticTrainer`, a ``Trainer`` that runs elastic.

``ElasticTrainer(model, args=TrainingArguments(...), train_dataset=..., replicas=3)`` takes
what ``Trainer`` takes and trains through :func:`planaria.fit`; every ``TrainingArguments``
field is honoured, harmless (named), or refused by name (see
:mod:`planaria.integrations.transformers.arguments`).
"""

try:
    import transformers as _transformers  # noqa: F401  (the guard: a clear error without it)
except ImportError as err:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "planaria.integrations.transformers needs Hugging Face transformers, accelerate and "
        'datasets: pip install "planaria[hf]"'
    ) from err

from planaria.integrations.transformers.arguments import TrainingPlan, plan_training
from planaria.integrations.transformers.trainer import ElasticTrainer

__all__ = ["ElasticTrainer", "TrainingPlan", "plan_training"]
