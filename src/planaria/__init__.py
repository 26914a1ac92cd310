"""planaria: elastic, fault-tolerant training of PyTorch models.

One long-lived controller drives replaceable worker replicas (Ray actors); a
worker's death reaches the controller as an exception and training goes on in
the same process.
"""

from planaria._version import __version__
from planaria.checkpoint.config import CheckpointConfig
from planaria.config import RunConfig, TrainSpec
from planaria.control.job import Job, StepResult
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
from planaria.fit import FitResult, fit
from planaria.retry import elastic_retry
from planaria.wire.evaluation import EvalResult

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
