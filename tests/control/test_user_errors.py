"""The user's mistakes read as the user's: a dataset path that does not exist stops the job
at its start with the path in the error's first line, and an out-of-memory stops after one
retry with what to lower. Real workers."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import ray
import torch

from planaria import fit
from planaria.examples import mlp
from planaria.faults.errors import OutOfMemory, WorkFault
from tests.assertions import events, of

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def missing_dataset() -> torch.utils.data.Dataset:
    with open("/nonexistent/planaria-test/train.bin", "rb") as f:  # a typo in the path
        return f.read()


def out_of_memory(model, batch):
    raise torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.10 GiB total capacity)")


def test_a_missing_dataset_path_stops_at_the_start_with_the_path(tmp_path):
    spec = dataclasses.replace(mlp.make_spec(n=256), dataset=missing_dataset)
    with pytest.raises(WorkFault) as stopped:
        fit(spec, steps=4, replicas=2, run_dir=tmp_path)
    first = str(stopped.value).splitlines()[0]
    assert "FileNotFoundError" in first and "/nonexistent/planaria-test/train.bin" in first
    evs = events(tmp_path)
    assert len(of(evs, "replacement_failed")) == 2  # the two first starts; none after them
    assert not of(evs, "worker_started")


def test_an_out_of_memory_is_retried_once_then_stops_with_the_hint(tmp_path):
    spec = dataclasses.replace(mlp.make_spec(n=256), loss=out_of_memory)
    with pytest.raises(OutOfMemory) as stopped:
        fit(spec, steps=4, replicas=2, run_dir=tmp_path)
    first = str(stopped.value).splitlines()[0]
    assert "out of memory" in first and "micro_batch_size" in first
    assert len(of(events(tmp_path), "fault")) <= 2
