"""A Hugging Face ``datasets.Dataset`` (Arrow, map-style) as it is, as a TrainSpec dataset:
its fingerprint, the ledger's digests and the loader (with and without loader processes)
handle its dict rows, and a job on it is exactly-once through a kill and trains as the
fault-free run."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import ray
import torch
from torch import nn

from planaria import TrainSpec, fit
from planaria.data.integrity import dataset_fingerprint, sample_digest
from planaria.data.map_style import check_map_style
from planaria.examples import mlp
from planaria.worker.loader import SampleLoader
from planaria.worker.vitals import Vitals
from tests.assertions import assert_exactly_once, assert_same_state, events, of

datasets = pytest.importorskip("datasets")

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, G, MBS, STEPS = 192, 24, 4, 8


def arrow_dataset(torch_format: bool = True):
    """mlp's regression data as an Arrow table (``with_format("torch")``: tensors, else the
    plain rows: dicts of lists and floats)."""
    source = mlp.Regression(n=N)
    table = datasets.Dataset.from_dict({"x": source.x.numpy(), "y": source.y.numpy()})
    return table.with_format("torch") if torch_format else table


def mse(model: nn.Module, batch: dict) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


def make_spec() -> TrainSpec:
    return TrainSpec(model=mlp.make_model, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
                     loss=mse, dataset=arrow_dataset, global_batch_size=G,
                     micro_batch_size=MBS, grad_clip_norm=1.0, name="hf-datasets")


@pytest.mark.parametrize("torch_format", [True, False], ids=["torch", "plain"])
def test_the_fingerprint_and_digests_of_arrow_rows(torch_format):
    a, b = arrow_dataset(torch_format), arrow_dataset(torch_format)
    check_map_style(a)
    assert dataset_fingerprint(a, 0) == dataset_fingerprint(b, 0)
    assert sample_digest(a[3]) == sample_digest(b[3]) != sample_digest(a[4])
    row = a[3]
    assert set(row) == {"x", "y"}
    assert isinstance(row["x"], torch.Tensor) == torch_format


@pytest.mark.parametrize("processes", [0, 2])
def test_the_loader_serves_arrow_rows(processes):
    loader = SampleLoader("w0", make_spec(), torch.device("cpu"),
                          Vitals("w0", lambda: 0, 1.0, cpu=True), k=1, shard_index=0,
                          threads=1, record_digests=True, prefetch=None, processes=processes)
    loader.setup()
    try:
        ids = np.arange(8) * 3
        loaded = loader.load(ids, 0, 0)
    finally:
        loader.close()
    reference = arrow_dataset()
    assert loaded.served.ids == ids.tolist()
    assert loaded.served.digests == [sample_digest(reference[i]) for i in ids.tolist()]
    (n, batch), _ = loaded.batches
    assert n == MBS and batch["x"].shape == (MBS, 32)
    torch.testing.assert_close(batch["x"], reference[ids[:MBS].tolist()]["x"], atol=0, rtol=0)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_an_arrow_dataset_job_is_exactly_once_through_a_kill(tmp_path):
    reference = fit(make_spec(), steps=STEPS, replicas=1, run_dir=tmp_path / "ref")
    killed = fit(make_spec(), steps=STEPS, replicas=3, run_dir=tmp_path / "kill", ledger=True,
                 chaos="kill:w1@step4")
    assert killed.final_step == STEPS
    assert_same_state(reference.state_dict, killed.state_dict)
    # Every served sample's content digest is the Arrow row's of the same id.
    assert_exactly_once(tmp_path / "kill", num_samples=N, global_batch_size=G, steps=STEPS,
                        dataset=arrow_dataset())
    evs = events(tmp_path / "kill")
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_lost"]
    assert all(r["lost_steps"] == 0 for r in of(evs, "recovered"))
    assert not of(evs, "dataset_global_rng")
