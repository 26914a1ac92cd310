"""Datasets that draw from the global generators in ``__getitem__`` (random augmentation
torchvision-style, numpy's or Python's global generator) train the same at any width and
through a kill, with the loader thread on or off; a dataset whose samples change when
served again is named in the event log.

Pure functions first (no Ray), then real workers.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import sys

import numpy as np
import pytest
import ray
import torch

import planaria
from planaria import Job, RunConfig, fit
from planaria.data.integrity import ServedAgain
from planaria.data.plan import Ledger
from planaria.data.randomness import GlobalStates, drawn_from, probe_sample, serve_samples
from planaria.examples import bn_mlp, mlp
from tests.assertions import assert_exactly_once, assert_same_state, events, of, run_to
from tests.loop_faults import SignalSelfAt, install

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, G, MBS, STEPS = 256, 48, 8, 10
ray_test = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


class TorchAugmented(mlp.Regression):
    """The torchvision style: noise from torch's global generator."""

    def __init__(self) -> None:
        super().__init__(n=N)

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return x + 0.1 * torch.randn_like(x), y


class NumpyAugmented(TorchAugmented):
    """Noise from numpy's legacy global generator."""

    def __getitem__(self, i: int):
        x, y = mlp.Regression.__getitem__(self, i)
        return x + torch.from_numpy(0.1 * np.random.randn(32).astype(np.float32)), y


class PythonAugmented(TorchAugmented):
    """A random scale from Python's ``random``."""

    def __getitem__(self, i: int):
        x, y = mlp.Regression.__getitem__(self, i)
        return x * random.uniform(0.8, 1.2), y


DATASETS = {"torch": TorchAugmented, "numpy": NumpyAugmented, "random": PythonAugmented}


# ---- pure functions ------------------------------------------------------------------------


def _draw_all(i: int):
    return torch.randn(3), float(np.random.rand()), random.random()


def _scramble(k: int) -> None:
    """Global generators in some state a caller left them in."""
    torch.manual_seed(k)
    np.random.seed(k)
    random.seed(k)


def test_the_probe_names_the_generators_a_sample_draws_from_and_changes_none():
    _scramble(1)
    before = GlobalStates.save()
    assert probe_sample(0, -1, _draw_all, 3)[1] == ("torch", "numpy", "random")
    for name, data in DATASETS.items():
        assert probe_sample(0, -1, data().__getitem__, 3)[1] == (name,)
    for quiet in (mlp.Regression(n=8).__getitem__,  # the sample's own stream: no global draw
                  lambda i: torch.randn(2, generator=planaria.sample_generator())):
        assert probe_sample(0, -1, quiet, 3)[1] == ()
    assert drawn_from(before, GlobalStates.save()) == ()  # the caller's states, untouched
    _scramble(2)
    again = probe_sample(0, -1, _draw_all, 3)[0]
    assert torch.equal(again[0], probe_sample(0, -1, _draw_all, 3)[0][0])  # seeded per sample


def test_reseeded_samples_depend_on_the_sample_alone_and_the_callers_streams_go_on():
    _scramble(1)
    whole = serve_samples(0, 5, _draw_all, [4, 7, 9], reseed=True)
    _scramble(2)
    parts = serve_samples(0, 5, _draw_all, [9], True) + serve_samples(0, 5, _draw_all, [7], True)
    for a, b in zip(whole[::-1][:2], parts, strict=True):  # any order, rank, thread or history
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
    assert not torch.equal(whole[0][0], serve_samples(0, 6, _draw_all, [4], True)[0][0])
    # The caller's streams go on as if the samples had not been served (an error too).
    _scramble(3)
    expected = _draw_all(0)
    _scramble(3)
    serve_samples(0, 5, _draw_all, [4, 7], reseed=True)
    with pytest.raises(ZeroDivisionError):
        serve_samples(0, 5, lambda i: (_draw_all(i), 1 / 0), [4], reseed=True)
    got = _draw_all(0)
    assert torch.equal(expected[0], got[0]) and expected[1:] == got[1:]


def test_served_again_names_the_samples_whose_content_changed():
    seen = ServedAgain(keep=10)
    assert seen.observe(5, [3, 1, 2], [10, 11, 12]) == []  # first served
    assert seen.observe(5, [2, 4], [12, 13]) == []  # again, the same; and a new one
    assert seen.observe(5, [3, 4, 1, 3], [99, 13, 11, 99]) == [3]
    assert seen.observe(6, [3], [99]) == []  # another step: another augmentation
    assert seen.observe(6, [3], [98]) == [3]
    assert seen.observe(7, list(range(9)), [0] * 9) == []  # 10 samples held at most
    assert seen.observe(5, [3], [1]) == []  # forgotten: step 5 is the oldest


def test_the_ledger_reports_a_sample_served_again_with_other_content(tmp_path):
    changed = []
    ledger = Ledger(tmp_path, on_changed=lambda *args: changed.append(args))
    ledger.served(5, gen=0, worker="w0", ids=[1, 2], digests=[7, 8])
    ledger.served(5, gen=0, worker="w1", ids=[3, 4], digests=[9, 10])
    ledger.served(5, gen=1, worker="w0", ids=[1, 2, 3], digests=[7, 8, 11])
    ledger.served(5, gen=1, worker="w2", ids=[4], digests=[10])
    ledger.close()
    assert changed == [(5, 1, "w0", [3])]


def spec_of(dataset):
    """The BatchNorm + dropout model (the training thread draws from torch's global
    generator too) on an augmenting dataset."""
    return dataclasses.replace(
        bn_mlp.make_spec(n=N, global_batch_size=G, micro_batch_size=MBS), dataset=dataset
    )


@pytest.fixture(scope="module")
def references(tmp_path_factory, ray_cluster):
    """Each augmenting dataset trained fault-free on one replica, without a loader thread."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            run_dir = tmp_path_factory.mktemp(f"ref_{name}")
            result = fit(spec_of(DATASETS[name]), steps=STEPS, replicas=1, run_dir=run_dir,
                         prefetch=False)
            cache[name] = result.state_dict
        return cache[name]

    return get


@pytest.mark.parametrize("prefetch", [True, False], ids=["loader_thread", "inline"])
# numpy and random: the same mechanism as torch (extended)
@pytest.mark.parametrize("name", [n if n == "torch" else pytest.param(n, marks=pytest.mark.extended)
                                  for n in DATASETS])
@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_augmenting_dataset_trains_the_same_at_any_width_and_through_a_kill(
    tmp_path, references, name, prefetch
):
    reference = references(name)
    wide = fit(spec_of(DATASETS[name]), steps=STEPS, replicas=3, run_dir=tmp_path / "wide",
               prefetch=prefetch)
    assert_same_state(reference, wide.state_dict)
    killed = fit(spec_of(DATASETS[name]), steps=STEPS, replicas=3, run_dir=tmp_path / "kill",
                 prefetch=prefetch, ledger=True, chaos="kill:w1@step5")
    assert killed.final_step == STEPS
    evs = events(tmp_path / "kill")
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_lost"]
    assert_same_state(reference, killed.state_dict)
    assert_exactly_once(tmp_path / "kill", num_samples=N, global_batch_size=G, steps=STEPS)
    # Said once, at start; and the step served again after the kill was the same.
    (drawn,) = of(evs, "dataset_global_rng")
    assert drawn["generators"] == [name] and drawn["loader_thread"] is False
    assert not of(evs, "dataset_nondeterministic")


def _loads_in_background(worker) -> bool:
    return bool(worker.loader.prefetch_on)


@pytest.mark.parametrize("dataset", [mlp.Regression, TorchAugmented], ids=["quiet", "torch"])
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_only_a_dataset_drawing_from_the_globals_loses_the_loader_thread(tmp_path, dataset):
    cfg = RunConfig(steps=2, replicas=2, run_dir=tmp_path, prefetch=True)
    with Job(spec_of(lambda: dataset(n=N) if dataset is mlp.Regression else dataset()),
             cfg) as job:
        job.train_step()
        background = [ray.get(h.actor.__ray_call__.remote(_loads_in_background), timeout=30)
                      for h in job.members]
    draws = of(events(tmp_path), "dataset_global_rng")
    if dataset is mlp.Regression:  # the fast path, as before
        assert background == [True, True] and not draws
    else:
        assert background == [False, False] and draws[0]["generators"] == ["torch"]


class Counting(mlp.Regression):
    """Not deterministic: each call's sample depends on how many calls this process made."""

    def __init__(self) -> None:
        super().__init__(n=N)
        self.calls = 0

    def __getitem__(self, i: int):
        self.calls += 1
        x, y = super().__getitem__(i)
        return x + 1e-3 * self.calls, y


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_nondeterministic_dataset_served_again_after_a_kill_is_named(tmp_path):
    # w1 dies at step 5 once it has computed (what it was served is in the ledger), before
    # the reduction: step 5's attempt breaks, and runs again at width 2.
    config = RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True)
    with Job(spec_of(Counting), config) as job:
        job.run_steps(1)
        install(job, "w1", SignalSelfAt(5, "computed", signal.SIGKILL, str(tmp_path / "hit")))
        run_to(job, STEPS)
    evs = events(tmp_path)
    assert [e["step"] for e in of(evs, "step_failed")] == [5]
    changed = of(evs, "dataset_nondeterministic")
    step = 5
    assert changed and {e["step"] for e in changed} == {step}
    # Every sample of the broken attempt the ledger holds was served again, otherwise.
    records = Ledger.read(tmp_path)
    commit_gen = next(r["gen"] for r in records if r["kind"] == "commit" and r["step"] == step)
    broken = {i for r in records if r["kind"] == "served" and r["step"] == step
              and r["gen"] != commit_gen for i in r["ids"]}
    assert broken and {i for e in changed for i in e["samples"]} == broken
    assert sum(e["count"] for e in changed) == len(broken)
    assert "not deterministic" in changed[0]["message"]
    assert not of(evs, "dataset_global_rng")
