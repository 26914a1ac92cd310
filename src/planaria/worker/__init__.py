"""The worker: a thin Ray actor (:class:`Worker`) composed of small parts (see
:mod:`planaria.worker.actor`)."""

from planaria.worker.actor import CONCURRENCY_GROUPS, Worker
from planaria.worker.reduce import FP32_EXACT_COUNT, STATUS_TAIL, Reducer, status_in_tail
from planaria.worker.run_loop import STATUS

__all__ = [
    "CONCURRENCY_GROUPS",
    "FP32_EXACT_COUNT",
    "STATUS",
    "STATUS_TAIL",
    "Reducer",
    "Worker",
    "status_in_tail",
]
