"""Replicas that cannot drift and data that can be proven.

Pure functions first (no Ray); then real workers: width-invariant randomness,
BatchNorm buffers kept identical, datasets seeded and fingerprinted, the
ledger's record of what the datasets served, and the replica checksum check.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from torch import nn

import planaria
from planaria import DataMismatch, Job, RunConfig, TrainSpec, fit
from planaria.data.integrity import (
    dataset_fingerprint,
    describe_mismatch,
    divergent_replicas,
    sample_digest,
)
from planaria.data.plan import Ledger, micro_batch_range, split_micro_batches
from planaria.data.randomness import micro_batch_seed, sample_scope, sample_seed
from planaria.examples import bn_mlp, mlp
from planaria.examples.mlp import mse
from planaria.faults.errors import ConfigError
from planaria.worker.buffers import BufferSync
from planaria.worker.reduce import STATUS_TAIL
from tests.assertions import assert_exactly_once, assert_same_state, events, of, run_to

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, G, STEPS = 256, 48, 12
ray_test = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


# ---- pure functions ------------------------------------------------------------------------


def test_micro_batches_are_whole_and_in_place_at_any_width():
    ids = np.arange(48)
    for width in (1, 2, 3, 4, 5):
        parts = split_micro_batches(ids, width, 8)
        assert np.concatenate(parts).tolist() == ids.tolist()
        for rank, part in enumerate(parts):
            first, count = micro_batch_range(6, width, rank)
            assert part.tolist() == list(range(first * 8, (first + count) * 8))
    assert [len(p) for p in split_micro_batches(ids, 4, 8)] == [16, 16, 8, 8]
    assert [len(p) for p in split_micro_batches(np.arange(16), 3, 8)] == [8, 8, 0]


def test_more_replicas_than_micro_batches_is_a_config_error(tmp_path):
    spec = mlp.make_spec(n=N, global_batch_size=32, micro_batch_size=16)
    with pytest.raises(ConfigError, match=r"replicas=3 .* has 2 \(global_batch_size=32"):
        Job(spec, RunConfig(steps=1, replicas=3, run_dir=tmp_path))
    with pytest.raises(ConfigError, match="verify_every"):
        RunConfig(steps=1, replicas=1, run_dir=tmp_path, verify_every=0)


def test_seeds_are_distinct_and_sample_seed_is_scoped():
    assert micro_batch_seed(0, 1, 2) != micro_batch_seed(0, 2, 1)
    assert micro_batch_seed(0, 1, 2) == micro_batch_seed(0, 1, 2)
    with pytest.raises(planaria.PlanariaError, match="only defined"):
        sample_seed()
    with sample_scope(0, 3, 7):
        a = sample_seed()
    with sample_scope(0, 3, 7):
        assert sample_seed() == a
    with sample_scope(0, 4, 7):
        assert sample_seed() != a


def test_sample_digest_sees_content_dtype_and_structure():
    x = torch.arange(4, dtype=torch.float32)
    assert sample_digest((x, 1)) == sample_digest((x.clone(), 1))
    assert sample_digest((x, 1)) != sample_digest((x, 2))
    assert sample_digest(x) != sample_digest(x.double())
    assert sample_digest({"a": x, "b": b"z"}) == sample_digest({"b": b"z", "a": x})
    assert sample_digest(np.zeros(3)) != sample_digest(np.zeros(4))


def test_fingerprints_name_what_differs():
    a = dataset_fingerprint(mlp.Regression(n=64), seed=0)
    assert describe_mismatch({"w0": a, "w1": dataset_fingerprint(mlp.Regression(n=64), 0)}) is None
    shorter = dataset_fingerprint(mlp.Regression(n=63), seed=0)
    msg = describe_mismatch({"w0": a, "w1": a, "w2": shorter})
    assert msg == "dataset length differs: w0, w1: 64 samples; w2: 63 samples"
    other = dataset_fingerprint(mlp.Regression(n=64, seed=1), seed=0)
    msg = describe_mismatch({"w0": a, "w1": other})
    assert msg is not None and "content differs at sampled positions" in msg and "w1:" in msg


def test_divergent_replicas_is_the_minority_or_everyone():
    assert divergent_replicas({"w0": 1, "w1": 1, "w2": 1}) == ()
    assert divergent_replicas({"w0": 1, "w1": 2, "w2": 1}) == ("w1",)
    assert divergent_replicas({"w0": 1, "w1": 2}) == ("w0", "w1")
    assert divergent_replicas({"w0": 1, "w1": 2, "w2": 3}) == ("w0", "w1", "w2")


class _Counted(nn.Module):
    """A module with a float buffer of its own (a running sum) and a non-persistent one,
    both changed by forward: the first is averaged, the second left alone."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(1))
        self.register_buffer("calls", torch.zeros(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total += x.sum().detach()
        self.calls.add_(1.0)
        return x


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1), nn.BatchNorm1d(1), _Counted()
    )


def test_buffer_sync_composes_batchnorm_statistics_like_one_replica():
    """Three simulated ranks, their contributions summed, equal one replica running all
    micro-batches in order; a rank's own changes are undone until the step commits."""
    batches = [torch.randn(5, 4) * (j + 1) + j for j in range(7)]
    one = _bn_model()
    for b in batches:
        one(b)
    ranks = [_bn_model() for _ in range(3)]
    syncs = [BufferSync(m) for m in ranks]
    flats = []
    for r, (model, sync) in enumerate(zip(ranks, syncs, strict=True)):
        sync.begin()
        first, count = micro_batch_range(7, 3, r)
        for b in batches[first : first + count]:
            model(b)
        flats.append(sync.contributions(rank=r, width=3, first=first, count=count, total=7))
    mean_total = sum(m[4].total.clone() for m in ranks) / 3
    total = [sum(parts) for parts in zip(*flats, strict=True)]
    for sync in syncs:
        sync.reduced([t.clone() for t in total])
        sync.commit()
    expected = one.state_dict()
    # A plain float buffer takes the mean of the ranks' values, not one replica's sum.
    expected["4.total"] = mean_total
    for model in ranks:
        assert_same_state(expected, model.state_dict(), atol=1e-6, rtol=1e-5)
    assert [float(m[4].calls) for m in ranks] == [3.0, 2.0, 2.0]
    assert int(ranks[1][1].num_batches_tracked) == 7
    before = {k: v.clone() for k, v in ranks[0].state_dict().items()}
    syncs[0].begin()
    ranks[0](batches[0])
    syncs[0].rollback()
    for k, v in ranks[0].state_dict().items():
        assert torch.equal(v, before[k]), k


def test_ledger_keeps_every_record_and_the_committing_attempt_counts(tmp_path):
    ledger = Ledger(tmp_path, run_id="a")
    ledger.served(0, gen=0, worker="w0", ids=[1, 2])
    ledger.commit(0, gen=0)
    ledger.served(1, gen=0, worker="w0", ids=[3, 4])  # its step failed: no commit
    ledger.served(1, gen=1, worker="w1", ids=[4])
    ledger.served(1, gen=1, worker="w2", ids=[3])
    ledger.commit(1, gen=1)
    ledger.close()
    with (tmp_path / Ledger.FILE).open("a") as f:
        f.write('{"kind":"commit","run":"a","st')  # torn by a crash
    resumed = Ledger(tmp_path, run_id="b")  # a later run re-does step 1 after a crash
    resumed.served(1, gen=0, worker="w5", ids=[3, 4], digests=[7, 8])
    resumed.commit(1, gen=0)
    resumed.close()
    assert len(Ledger.read(tmp_path)) == 8
    assert Ledger.committed(tmp_path) == {0: [1, 2], 1: [3, 4]}
    assert [r["worker"] for r in Ledger.committed_records(tmp_path)[1]] == ["w5"]


# ---- real workers ----------------------------------------------------------------------------


def train(spec: TrainSpec, run_dir: Path, *, replicas: int, steps: int = STEPS, **options):
    """fit()'s loop on a Job; returns (final model state, every replica's checksum)."""
    with Job(spec, RunConfig(steps=steps, replicas=replicas, run_dir=run_dir, **options)) as job:
        while job.steps_done < steps:
            try:
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        sums = job.checksums()
        return job.model_state_dict(), sums


BN_SPEC = bn_mlp.make_spec(n=N, global_batch_size=G, micro_batch_size=8)


@pytest.fixture(scope="module")
def bn_reference(tmp_path_factory, ray_cluster):
    """The BatchNorm + dropout model trained fault-free on one replica."""
    state, _ = train(BN_SPEC, tmp_path_factory.mktemp("bn_one"), replicas=1)
    return state


@pytest.mark.parametrize("replicas", [3])
@pytest.mark.multiprocess
@pytest.mark.slow
def test_dropout_and_batchnorm_are_width_invariant(tmp_path, bn_reference, replicas):
    state, sums = train(BN_SPEC, tmp_path, replicas=replicas, ledger=True)
    assert len(set(sums.values())) == 1, f"replicas differ (buffers included): {sums}"
    # Parameters, running statistics and batch counts equal one replica's, up to float order.
    assert_same_state(bn_reference, state, atol=1e-5, rtol=1e-4)
    assert int(state["1.num_batches_tracked"]) == STEPS * G // 8
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS,
                        dataset=mlp.Regression(n=N))


def _mse_with_many_metrics(model, batch):
    """The BatchNorm model's loss with more metrics than the gradient buffer's status tail
    holds: the step's status travels beside the gradient."""
    loss = mse(model, batch)
    return loss, {f"m{i:02d}": float(i) for i in range(STATUS_TAIL)}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_status_beside_the_gradient_leaves_the_buffers_alone_at_width_one(tmp_path,
                                                                           bn_reference):
    # One replica sums no buffer contributions; the status sent beside the gradient once
    # reached the buffers' update as if it were their sums.
    spec = dataclasses.replace(BN_SPEC, loss=_mse_with_many_metrics)
    state, _ = train(spec, tmp_path, replicas=1)
    assert_same_state(bn_reference, state, atol=1e-5, rtol=1e-4)
    assert int(state["1.num_batches_tracked"]) == STEPS * G // 8


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_kill_changes_nothing_with_dropout_and_batchnorm(tmp_path, bn_reference):
    import signal

    from tests.loop_faults import SignalSelfAt, install

    with Job(BN_SPEC, RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True)) as job:
        # w1 dies in step 5 once its samples are served and recorded, before the reduction.
        install(job, "w1", SignalSelfAt(5, "computed", signal.SIGKILL, str(tmp_path / "killed")))
        state = run_to(job, STEPS)
        assert job.steps_done == STEPS
    assert (tmp_path / "killed").read_text() == "w1"
    assert_same_state(bn_reference, state, atol=1e-5, rtol=1e-4)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS,
                        dataset=mlp.Regression(n=N))
    evs = events(tmp_path)
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_lost"]
    records = Ledger.read(tmp_path)
    commits = [r for r in records if r["kind"] == "commit"]
    assert [r["step"] for r in commits] == list(range(STEPS))
    served = [r for r in records if r["kind"] == "served"]
    committing = {(r["gen"], r["step"]) for r in commits}
    counted = [r for r in served if (r["gen"], r["step"]) in committing]
    assert len(counted) == sum(e["width"] for e in of(evs, "step_committed"))
    # Every record is kept: the survivors' records of the attempt the kill broke too, and
    # the dead worker's, served before the kill (the autonomous loop keeps it in the store
    # before the step's collective).
    failed = {(r["step"], r["worker"]) for r in served if (r["gen"], r["step"]) not in committing}
    assert failed == {(5, "w0"), (5, "w1"), (5, "w2")}


class NumpyGlobalData(torch.utils.data.Dataset):
    """What a user writes: random data from numpy's global generator, no seed of its own,
    and a random augmentation drawn from the sample's own generator."""

    def __init__(self, n: int = N) -> None:
        self.x = torch.from_numpy(np.random.randn(n, 32).astype(np.float32))
        self.y = torch.from_numpy(np.random.randn(n, 1).astype(np.float32))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        noise = 0.1 * torch.randn(32, generator=planaria.sample_generator())
        return self.x[i] + noise, self.y[i]


class PerProcessData(NumpyGlobalData):
    def __init__(self) -> None:
        import os

        np.random.seed(os.getpid())
        super().__init__()


def _spec_with(dataset) -> TrainSpec:
    import dataclasses

    return dataclasses.replace(mlp.make_spec(n=N, global_batch_size=G, micro_batch_size=8),
                               dataset=dataset)


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_dataset_from_numpys_global_generator_is_the_same_everywhere(tmp_path):
    spec = _spec_with(NumpyGlobalData)
    one, _ = train(spec, tmp_path / "one", replicas=1, steps=6)
    three, sums = train(spec, tmp_path / "three", replicas=3, steps=6)
    assert len(set(sums.values())) == 1
    assert_same_state(one, three, atol=1e-6, rtol=1e-5)


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_per_process_dataset_is_refused_at_start(tmp_path):
    with pytest.raises(DataMismatch, match="content differs at sampled positions") as info:
        fit(_spec_with(PerProcessData), steps=4, replicas=2, run_dir=tmp_path)
    assert "w0" in str(info.value) and "w1" in str(info.value)
    evs = events(tmp_path)
    assert of(evs, "data_mismatch") and of(evs, "run_end")[0]["status"] == "aborted"
    assert not of(evs, "step_committed")


def _data_changes_after(marker: str):
    def factory():
        data = mlp.Regression(n=N)
        if Path(marker).exists():  # a node that reads other files than the job started with
            data.y += 1.0
        return data

    return factory


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_replacement_with_other_data_is_refused(tmp_path):
    marker = tmp_path / "changed"
    spec = _spec_with(_data_changes_after(str(marker)))
    cfg = RunConfig(steps=STEPS, replicas=2, run_dir=tmp_path / "run")
    with pytest.raises(DataMismatch, match=r"w2 built a different dataset") as info, \
            Job(spec, cfg, chaos=planaria.ChaosPlan.parse("kill:w1@step2")) as job:
        marker.touch()
        while job.steps_done < STEPS:
            try:
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
            job.wait_for_width(2, timeout_s=120)
    assert "content differs" in str(info.value)
    refused = of(events(tmp_path / "run"), "worker_refused")
    assert [e["worker"] for e in refused] == ["w2"]


class Remapped(mlp.Regression):
    """Serves sample 5 whenever it is asked for sample 3 (a bug in the user's index map)."""

    def __init__(self) -> None:
        super().__init__(n=N)

    def __getitem__(self, i: int):
        return super().__getitem__(5 if i == 3 else i)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_the_ledger_catches_a_dataset_that_serves_other_samples(tmp_path):
    fit(_spec_with(Remapped), steps=6, replicas=2, run_dir=tmp_path, ledger=True)
    # The ids asked for are right, so only what was served can show it.
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=6)
    with pytest.raises(AssertionError, match="other content for sample 3"):
        assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=6,
                            dataset=mlp.Regression(n=N))


def _nudge(worker) -> int:
    """Runs inside a worker: a silent change to one parameter (a flipped bit, a bad kernel)."""
    with torch.no_grad():
        next(worker.state.model.parameters()).view(-1)[0] += 1e-3
    return 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_diverged_replica_is_detected_and_replaced(tmp_path, bn_reference):
    spec = BN_SPEC
    cfg = RunConfig(steps=STEPS, replicas=3, run_dir=tmp_path, verify_every=2)
    nudged = False
    with Job(spec, cfg) as job:
        while job.steps_done < STEPS:
            if job.steps_done == 6 and not nudged:
                # After step 5 committed, before the check at the next boundary: no step
                # computes with the nudged parameters, so the majority stays exact.
                job.commit_all()
                ray.get(job.members[1].actor.__ray_call__.remote(_nudge), timeout=30)
                nudged = True
            try:
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        sums = job.checksums()
        state = job.model_state_dict()
    assert len(set(sums.values())) == 1
    assert_same_state(bn_reference, state, atol=1e-5, rtol=1e-4)
    evs = events(tmp_path)
    (fault,) = of(evs, "fault")
    assert fault["kind"] == "replica_divergence" and fault["worker"] == "w1"
    assert fault["step"] == 6
    checks = of(evs, "replicas_verified")
    assert [c["step"] for c in checks][:3] == [2, 4, 6] and checks[2]["diverged"] == ["w1"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_divergence_without_a_majority_restores_the_checkpoint(tmp_path, bn_reference):
    from planaria.checkpoint.config import CheckpointConfig

    cfg = RunConfig(steps=STEPS, replicas=2, run_dir=tmp_path, verify_every=2)
    nudged = False
    with Job(BN_SPEC, cfg, checkpoint=CheckpointConfig(every=2)) as job:
        while job.steps_done < STEPS:
            if job.steps_done == 6 and not nudged:
                job.checkpointer.finish_inflight()  # step 4's background save commits first
                assert job.checkpointer.last_committed == 4
                job.commit_all()
                ray.get(job.members[1].actor.__ray_call__.remote(_nudge), timeout=30)
                nudged = True
            try:
                job.train_step()
            except planaria.Failure as failure:
                job.recovery.handle(failure)
        state = job.model_state_dict()
    assert_same_state(bn_reference, state, atol=1e-5, rtol=1e-4)
    evs = events(tmp_path)
    (fault,) = of(evs, "fault")
    assert fault["kind"] == "replica_divergence" and fault["worker"] == "w0,w1"
    # The boundary checks before it saves: the diverged state of step 6 was never saved,
    # and step 4's (committed before the nudge) is restored.
    (restore,) = of(evs, "restore")
    assert restore["step"] == 4 and restore["lost_steps"] == 2
    assert 6 not in [e["step"] for e in of(evs, "checkpoint_saved") if e["t"] < restore["t"]]
