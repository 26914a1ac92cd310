"""planaria: elastic, fault-tolerant training of PyTorch models.

One long-lived controller drives replaceable worker replicas (Ray actors); a
worker's death reaches the controller as an exception and training goes on in
the same process.
"""

from typing import TYPE_CHECKING

from planaria._version import __version__
from planaria.checkpoint.config import CheckpointConfig
from planaria.config import RunConfig, TrainSpec
from planaria.control.policy import HangConfig, RecoveryPolicy
from planaria.data.randomness import sample_generator, sample_seed
from planaria.faults.chaos import ChaosPlan
from planaria.faults.errors import (
    AllReplicasLost,
    CheckpointError,
    ConfigError,
    DataMismatch,
    ElasticRuntimeError,
    Failure,
    FinalSaveFailed,
    NonFiniteLoss,
    PlanariaError,
    Preempted,
    RayLost,
    ReplicaDivergence,
    UserCodeError,
    WorkerHung,
    WorkerLost,
    WorkerUnreachable,
    WorkFault,
)
from planaria.wire.evaluation import EvalResult

if TYPE_CHECKING:  # for type checkers and the API docs; at run time, __getattr__ below
    from planaria.control.job import Job, StepResult
    from planaria.fit import FitResult, fit
    from planaria.retry import elastic_retry

# The controller's entry points load on first use: a worker process imports this package
# too (every planaria module is under it), and the controller's modules (and their
# imports: rich, the checkpoint reader, ...) would cost each worker's start ~0.3 CPU-s.
_LAZY = {"Job": "planaria.control.job", "StepResult": "planaria.control.job",
         "FitResult": "planaria.fit", "fit": "planaria.fit", "elastic_retry": "planaria.retry"}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'planaria' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AllReplicasLost",
    "ChaosPlan",
    "CheckpointConfig",
    "CheckpointError",
    "ConfigError",
    "DataMismatch",
    "ElasticRuntimeError",
    "EvalResult",
    "Failure",
    "FinalSaveFailed",
    "FitResult",
    "HangConfig",
    "Job",
    "NonFiniteLoss",
    "PlanariaError",
    "Preempted",
    "RayLost",
    "RecoveryPolicy",
    "ReplicaDivergence",
    "RunConfig",
    "StepResult",
    "TrainSpec",
    "UserCodeError",
    "WorkFault",
    "WorkerHung",
    "WorkerLost",
    "WorkerUnreachable",
    "__version__",
    "elastic_retry",
    "fit",
    "sample_generator",
    "sample_seed",
]
