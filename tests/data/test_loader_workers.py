"""``RunConfig(loader_workers=N)``: samples decoded in processes beside each worker are the
samples of ``loader_workers=0`` (each with its own random stream), recorded alike, and the
processes end with their worker; a stream (an IterableDataset) is refused at job start.

Pure functions and in-process loaders first (no Ray), then real workers.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import ray
import torch

import planaria
from planaria import ConfigError, RunConfig, UserCodeError, fit
from planaria.data.map_style import check_map_style
from planaria.examples import mlp
from planaria.faults.errors import InfrastructureError
from planaria.worker.loader import SampleLoader
from planaria.worker.vitals import Vitals
from tests.assertions import assert_exactly_once, assert_same_state, events, of

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, G, MBS, STEPS = 192, 24, 4, 8


class Augmented(mlp.Regression):
    """Draws from every global generator and from its own stream; with ``pids`` (a folder),
    notes each loader process it runs in."""

    def __init__(self, pids: str | None = None) -> None:
        super().__init__(n=N)
        self.pids = pids

    def __getitem__(self, i: int):
        if self.pids and torch.utils.data.get_worker_info() is not None:
            Path(self.pids, str(os.getpid())).touch()
        x, y = super().__getitem__(i)
        noise = torch.randn(32, generator=planaria.sample_generator())
        return x + 0.1 * torch.randn_like(x) + 0.01 * noise + float(np.random.rand()) \
            * random.uniform(0.0, 0.1), y


class Own(mlp.Regression):
    """Draws from its own stream only (the loader thread's fast path when in-process)."""

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return x + torch.rand(32, generator=planaria.sample_generator()), y


class Failing(mlp.Regression):
    def __getitem__(self, i: int):
        if i == 7:
            raise KeyError(f"no sample {i}")
        return super().__getitem__(i)


def loader_of(dataset, processes: int) -> SampleLoader:
    spec = dataclasses.replace(mlp.make_spec(n=N, global_batch_size=G, micro_batch_size=MBS),
                               dataset=dataset)
    loader = SampleLoader("w0", spec, torch.device("cpu"), Vitals("w0", lambda: 0, 1.0, cpu=True),
                          k=1, shard_index=0, threads=1, record_digests=True, prefetch=None,
                          processes=processes)
    loader.setup()
    return loader


_OLDER: set[int] = set()
"""Children of the test session from before the test (a storage server's): not loaders."""


@pytest.fixture(autouse=True)
def _older_children():
    _OLDER.clear()
    _OLDER.update(p.pid for p in psutil.Process().children())


def children() -> list[psutil.Process]:
    """This process's children started by the test: its loader processes."""
    return [p for p in psutil.Process().children() if p.pid not in _OLDER]


def gone(pids, timeout_s: float) -> list[int]:
    """The pids still running (zombies are gone) after waiting up to ``timeout_s``."""
    deadline = time.time() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.5)


# ---- in-process loaders ----------------------------------------------------------------------

@pytest.mark.parametrize("dataset", [Augmented, lambda: Own(n=N)], ids=["globals", "own"])
def test_samples_from_loader_processes_are_those_of_the_worker(dataset):
    inline, forked = loader_of(dataset, 0), loader_of(dataset, 2)
    try:
        assert len(children()) == 2
        ids = np.random.default_rng(0).permutation(N)[:G]
        for step in (3, 4):
            torch.manual_seed(5)
            before = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
            a, b = inline.load(ids, step, 0), forked.load(ids, step, 0)
            after = torch.get_rng_state(), np.random.get_state()[1], random.getstate()
            assert torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1])
            assert before[2] == after[2]  # the worker's own streams go on untouched
            assert a.served.ids == b.served.ids == ids.tolist()
            assert a.served.digests == b.served.digests
            for (na, xa), (nb, xb) in zip(a.batches, b.batches, strict=True):
                assert na == nb == MBS
                assert all(torch.equal(u, v) for u, v in zip(xa, xb, strict=True))
        forked.skipped_samples = frozenset(ids[:MBS].tolist())  # a whole micro-batch skipped
        skipped = forked.load(ids, 5, 0)
        assert skipped.batches[0] == (0, None) and skipped.served.ids == ids[MBS:].tolist()
    finally:
        inline.close()
        forked.close()
    assert not children() or not gone([p.pid for p in children()], 10)


def test_a_dataset_error_in_a_loader_process_names_its_sample():
    loader = loader_of(lambda: Failing(n=N), 2)
    try:
        with pytest.raises(UserCodeError, match="dataset\\[i\\] raised KeyError") as info:
            loader.load(np.arange(16), 2, 1)
        assert info.value.work is not None
        assert (info.value.work.step, info.value.work.micro_batch,
                info.value.work.sample) == (2, 2, 7)
        assert "in a loader process" in "".join(info.value.__cause__.__notes__)
    finally:
        loader.close()


def test_a_loader_process_that_dies_is_the_workers_fault_and_none_is_left():
    loader = loader_of(lambda: mlp.Regression(n=N), 2)
    pids = [p.pid for p in children()]
    try:
        loader.load(np.arange(16), 0, 0)
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(InfrastructureError, match="loader process"):
            loader.load(np.arange(16, 32), 1, 0)
    finally:
        loader.close()
    assert not gone(pids, 15)


def test_loader_workers_is_checked():
    with pytest.raises(ConfigError, match="loader_workers=-1 is not valid"):
        RunConfig(steps=1, replicas=1, run_dir="runs/x", loader_workers=-1)
    assert RunConfig(steps=1, replicas=1, run_dir="runs/x").loader_workers == 0


# ---- streams ---------------------------------------------------------------------------------

class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from range(4)


def test_a_stream_is_refused_saying_why_and_the_way():
    with pytest.raises(ConfigError, match=r"torch\.utils\.data\.IterableDataset") as info:
        check_map_style(Stream())
    text = str(info.value)
    assert "exactly-once" in text and "addressable by an index" in text
    assert "from_generator" in text and "ConcatDataset" in text
    with pytest.raises(ConfigError, match="without __len__"):
        check_map_style(iter(range(3)))
    check_map_style(mlp.Regression(n=4))
    check_map_style([1, 2, 3])
    datasets = pytest.importorskip("datasets")
    stream = datasets.Dataset.from_dict({"x": [1, 2]}).to_iterable_dataset()
    with pytest.raises(ConfigError, match=r"built a datasets\.IterableDataset"):
        check_map_style(stream)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_job_on_a_stream_stops_at_start_with_the_reason(tmp_path):
    spec = dataclasses.replace(mlp.make_spec(n=N, global_batch_size=G, micro_batch_size=MBS),
                               dataset=Stream)
    with pytest.raises(ConfigError, match="not a map-style dataset: exactly-once"):
        fit(spec, steps=2, replicas=1, run_dir=tmp_path)


# ---- real workers ----------------------------------------------------------------------------

def spec_of(pids: str | None = None):
    return dataclasses.replace(mlp.make_spec(n=N, global_batch_size=G, micro_batch_size=MBS),
                               dataset=lambda: Augmented(pids))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_loader_workers_train_as_without_through_a_kill_every_sample_once(tmp_path):
    reference = fit(spec_of(), steps=STEPS, replicas=1, run_dir=tmp_path / "ref")
    pids = tmp_path / "pids"
    pids.mkdir()
    killed = fit(spec_of(str(pids)), steps=STEPS, replicas=3, run_dir=tmp_path / "kill",
                 loader_workers=2, ledger=True, chaos="kill:w1@step4")
    assert killed.final_step == STEPS
    assert_same_state(reference.state_dict, killed.state_dict)
    assert_exactly_once(tmp_path / "kill", num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path / "kill")
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_lost"]
    assert all(r["lost_steps"] == 0 for r in of(evs, "recovered"))
    assert not of(evs, "dataset_nondeterministic")
    (drawn,) = of(evs, "dataset_global_rng")
    assert drawn["loader_thread"] is True and "loader processes" in drawn["message"]
    # The loader processes of every worker (the killed one's too) are gone.
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) >= 6, started  # two a worker, three workers and a replacement
    assert not gone(started, 20), "loader processes left running"
