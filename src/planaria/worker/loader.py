"""A worker's samples: its share of a step, loaded, and the next step's loaded ahead.

A rank runs whole, contiguous micro-batches of the step's global batch
(:func:`planaria.data.plan.micro_batch_range`); a worker of a sharded replica runs
its part of its replica's. Each sample is served with its own random stream
(:func:`planaria.data.randomness.serve_samples`) and recorded as served.

The next step loads while this one runs: on a loader thread when the node has a
core to spare (``RunConfig.prefetch``), else on the training thread while the
gradient's all-reduce is in flight (:meth:`SampleLoader.load_planned`). The next
step takes what was loaded if its ids and step match (a width change or a re-run
loads again); a dataset error raised then is kept and raised by that next step,
as its own. A dataset that draws from the global generators always loads on the
training thread (see :mod:`planaria.data.randomness`).

With ``RunConfig.loader_workers=N`` the samples are decoded in N processes beside
the worker (:mod:`planaria.worker.loader_processes`), each served and recorded as
here; the loader thread (or the training thread) only waits for them.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from planaria.config import TrainSpec
from planaria.data.integrity import Served, dataset_fingerprint
from planaria.data.map_style import check_map_style
from planaria.data.plan import micro_batch_range
from planaria.data.randomness import probe_sample, serve_samples
from planaria.faults.errors import Failure, PlanariaError, Work
from planaria.faults.user_code import user_call
from planaria.wire.worker_markers import live_workers
from planaria.worker.busy import current_thread_ids
from planaria.worker.collective import Collective
from planaria.worker.loader_processes import LoaderProcesses
from planaria.worker.replica_state import run_factory
from planaria.worker.vitals import Vitals

__all__ = ["Loaded", "SampleLoader", "share_key", "to_device"]


@dataclass
class Loaded:
    """A rank's share of a step, loaded: (samples, batch) per micro-batch, and what was served."""

    batches: list[tuple[int, Any]]
    served: Served


def share_key(ids: np.ndarray, step: int) -> bytes:
    """What a share loaded ahead is found by: its ids and its step."""
    return ids.tobytes() + step.to_bytes(8, "little")


def to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class SampleLoader:
    """The dataset, this worker's share of each step, and the share loaded ahead."""

    def __init__(self, name: str, spec: TrainSpec, device: torch.device, vitals: Vitals, *,
                 k: int, shard_index: int, threads: int, record_digests: bool,
                 prefetch: bool | None, processes: int = 0) -> None:
        self.name = name
        self.spec = spec
        self.device = device
        self.vitals = vitals
        self.k, self.shard_index, self.threads = k, shard_index, threads
        self.record_digests = record_digests
        self.prefetch_setting = prefetch
        self.prefetch_on = bool(prefetch)  # decided at each join (see want_prefetch)
        self.processes = processes  # RunConfig.loader_workers
        self.pool: LoaderProcesses | None = None  # their loader, once the dataset is built
        # The global generators dataset[i] draws from, found at setup (fingerprint_sample):
        # if any, every sample is served with them seeded, on the training thread only.
        self.global_draws: set[str] = set()
        self.skipped_samples: frozenset[int] = frozenset()  # never loaded (a work fault)
        self.dataset: Any = None
        self.collate: Any = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planaria-loader")
        self.prefetched: tuple[bytes, Future[Loaded]] | None = None
        # The share load_planned loads (plan_ahead): its ids, step and first micro-batch.
        self.ahead_ids: np.ndarray | None = None
        self.ahead_step = self.ahead_first = 0

    def setup(self) -> tuple[int, dict[str, Any]]:
        """Builds the dataset from the spec; returns its size and fingerprint."""
        spec = self.spec
        self.dataset = run_factory("dataset", spec.seed, spec.dataset)
        check_map_style(self.dataset)  # a stream cannot be served exactly once
        if spec.collate is not None:
            self.collate = spec.collate
        else:
            from torch.utils.data import default_collate

            self.collate = default_collate
        num_samples = user_call("len(dataset)", len, self.dataset)
        self.global_draws = set()
        fingerprint = user_call(
            "dataset[i]", dataset_fingerprint, self.dataset, spec.seed, self.fingerprint_sample
        )
        if self.processes:
            if self.pool is not None:
                self.pool.close()
            self.pool = LoaderProcesses(
                self.name, self.dataset, processes=self.processes, seed=spec.seed,
                reseed=bool(self.global_draws), collate=self.collate,
                digests=self.record_digests)
            self.pool.start()
        return int(num_samples), fingerprint

    def fingerprint_sample(self, i: int) -> Any:
        """``dataset[i]`` at setup (step -1), noting the global generators it draws from."""
        sample, drawn = probe_sample(self.spec.seed, -1, self.dataset.__getitem__, i)
        self.global_draws.update(drawn)
        return sample

    def want_prefetch(self) -> bool:
        """RunConfig.prefetch, or (auto) whether this node has a core to spare for a loader
        thread: more cores than the planaria workers alive on it use. Never for a dataset
        that draws from the global generators: they are the process's, and the training
        thread draws from torch's (dropout) and seeds it while the loader thread would run.
        With loader processes (which own their generators) the thread only waits for them:
        on unless RunConfig.prefetch is False."""
        if self.pool is not None:
            return self.prefetch_setting is not False
        if self.global_draws:
            return False
        if self.prefetch_setting is not None:
            return self.prefetch_setting
        workers = max(1, len(live_workers()))
        return (os.cpu_count() or 1) > workers * self.threads

    # ---- shares ------------------------------------------------------------------------------

    def own_share(self, ids: np.ndarray, comm: Collective) -> tuple[int, int, np.ndarray, int]:
        """(first, count, ids, rounds): the micro-batches this worker runs of the ``ids`` its
        replica was given, and how many forwards each of the replica's workers makes."""
        first, count = self.micro_batches(len(ids), comm)
        if self.k == 1:
            return first, count, ids, count
        sub, own = micro_batch_range(count, self.k, self.shard_index)
        mbs = self.spec.micro_batch_size
        return first + sub, own, ids[sub * mbs : (sub + own) * mbs], -(-count // self.k)

    def micro_batches(self, n_ids: int, comm: Collective) -> tuple[int, int]:
        """(first, count): this rank's micro-batches in the global batch; checks the ids fit."""
        spec = self.spec
        total = spec.global_batch_size // spec.micro_batch_size
        first, count = micro_batch_range(total, comm.world_size, comm.rank)
        if n_ids != count * spec.micro_batch_size:
            raise PlanariaError(
                f"{self.name} (rank {comm.rank} of {comm.world_size}) got {n_ids} "
                f"ids, not its {count} micro-batches of {spec.micro_batch_size}"
            )
        return first, count

    # ---- loading -----------------------------------------------------------------------------

    def load(self, ids: np.ndarray, step: int, first: int = 0) -> Loaded:
        """Loads whole micro-batches (``first``: the first one's place in the global batch);
        runs in the loader thread (which touches no global generator), or on the training
        thread for a dataset that draws from them. Skipped samples (a work fault the user
        chose to skip) are left out; a micro-batch left with none is ``(0, None)``. Each
        sample bumps the progress, and the heartbeat names it."""
        if self.pool is not None:
            return self.load_in_processes(ids, step, first)
        mbs, seed, base = self.spec.micro_batch_size, self.spec.seed, self.dataset.__getitem__
        reseed = bool(self.global_draws)  # then never in the loader thread: want_prefetch
        vitals = self.vitals
        vitals.loader_thread = current_thread_ids()

        def getitem(i: int) -> Any:
            vitals.loading = f"i{i}"
            vitals.progress += 1
            return base(i)

        served = Served(digests_on=self.record_digests)
        skip = self.skipped_samples
        out: list[tuple[int, Any]] = []
        for start in range(0, len(ids), mbs):
            chunk = ids[start : start + mbs].tolist()
            if skip:
                chunk = [i for i in chunk if i not in skip]
            if not chunk:
                out.append((0, None))
                continue
            # dataset[i] for each, with the sample's own random stream, recorded as served
            try:
                samples = user_call("dataset[i]", serve_samples, seed, step, getitem, chunk, reseed)
            except Failure as err:
                sample = getattr(err.__cause__, "planaria_sample", None)
                err.work = Work(step=step, micro_batch=first + start // mbs, sample=sample)
                raise
            served.extend(chunk, samples)
            batch = user_call("collate", self.collate, samples)
            out.append((len(chunk), to_device(batch, self.device)))
        return Loaded(out, served)

    def load_in_processes(self, ids: np.ndarray, step: int, first: int) -> Loaded:
        """:meth:`load`, the samples decoded in the loader processes (micro-batches left
        with no sample are ``(0, None)`` as there; each micro-batch bumps the progress)."""
        assert self.pool is not None
        mbs, skip, vitals = self.spec.micro_batch_size, self.skipped_samples, self.vitals
        vitals.loader_thread = current_thread_ids()
        chunks = [ids[start : start + mbs].tolist() for start in range(0, len(ids), mbs)]
        if skip:
            chunks = [[i for i in chunk if i not in skip] for chunk in chunks]
        loaded = [chunk for chunk in chunks if chunk]

        def got(chunk: list[int]) -> None:
            vitals.loading = f"i{chunk[-1]}"
            vitals.progress += len(chunk)

        vitals.loading = f"i{loaded[0][0]}" if loaded else ""
        results = iter(self.pool.load(step, loaded, got) if loaded else ())
        served = Served(digests_on=self.record_digests)
        out: list[tuple[int, Any]] = []
        for n, chunk in enumerate(chunks):
            if not chunk:
                out.append((0, None))
                continue
            result = next(results)
            try:
                batch, digests = user_call(result.what or "dataset[i]", result.unwrap)
            except Failure as err:
                if result.what == "dataset[i]":  # as load's: the sample's work is named
                    sample = getattr(err.__cause__, "planaria_sample", None)
                    err.work = Work(step=step, micro_batch=first + n, sample=sample)
                raise
            served.add(chunk, digests)
            out.append((len(chunk), to_device(batch, self.device)))
        return Loaded(out, served)

    def key(self, ids: np.ndarray, step: int) -> bytes:
        """What a share loaded ahead is found by: its ids, its step and the skipped samples
        it was loaded without."""
        return share_key(ids, step) + hash(self.skipped_samples).to_bytes(8, "little",
                                                                          signed=True)

    def prefetch(self, ids: np.ndarray, step: int, first: int) -> None:
        """Starts loading step ``step``'s share on the loader thread (if it loads there)."""
        if not self.prefetch_on:
            return
        self.prefetched = (self.key(ids, step), self.executor.submit(self.load, ids, step, first))

    def on_join(self, next_ids: np.ndarray | None, steps_done: int, world_size: int,
                rank: int, skip: tuple[int, ...] | None) -> None:
        """At a join: whether to prefetch from now on, the samples the job skips (``skip``,
        None: unchanged), and this rank's share of the next step (``next_ids``) loading."""
        self.prefetch_on = self.want_prefetch()
        if skip is not None:
            self.skipped_samples = frozenset(skip)
        if next_ids is not None and len(next_ids):
            total = self.spec.global_batch_size // self.spec.micro_batch_size
            self.prefetch(next_ids, steps_done, micro_batch_range(total, world_size, rank)[0])

    def plan_ahead(self, ids: np.ndarray | None, step: int, first: int) -> None:
        """The share :meth:`load_planned` loads (None: nothing)."""
        self.ahead_ids, self.ahead_step, self.ahead_first = ids, step, first

    def load_planned(self) -> None:
        """Loads the planned share now, on this thread, while the gradient's all-reduce is in
        flight: the thread would only wait for it (without a spare core there is no loader
        thread, see :meth:`want_prefetch`); the next :meth:`take` finds it. A dataset error
        is kept for that step, which raises it as its own."""
        ids, step, first = self.ahead_ids, self.ahead_step, self.ahead_first
        if ids is None:
            return
        self.ahead_ids = None
        vitals = self.vitals
        phase, at = vitals.phase, vitals.phase_step
        vitals.set_phase("loading", step)  # its own work, not a wait on the peers
        future: Future[Loaded] = Future()
        try:
            future.set_result(self.load(ids, step, first))
        except Exception as err:  # the next step's error, not this one's
            future.set_exception(err)
        finally:
            vitals.set_phase(phase, at)
        self.prefetched = (self.key(ids, step), future)

    def take(self, ids: np.ndarray, step: int, first: int) -> Loaded:
        """Step ``step``'s share: the one loaded ahead if it is that one, else loaded now."""
        if self.prefetched is not None and self.prefetched[0] == self.key(ids, step):
            future = self.prefetched[1]
            self.prefetched = None
            return future.result()
        self.prefetched = None
        return self.load(ids, step, first)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.pool is not None:
            self.pool.close()
