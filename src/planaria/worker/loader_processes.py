"""Samples decoded in processes beside the worker (``RunConfig.loader_workers``).

For samples that are costly to decode (images, audio, tokenising on the fly): a
torch ``DataLoader`` with persistent worker processes, forked from the worker once
its dataset is built (the dataset is not pickled), computes ``dataset[i]`` for each
micro-batch of a share. Its batch sampler is the share's micro-batches, set before
every load; its dataset serves each micro-batch as the training thread would
(:func:`planaria.data.randomness.serve_samples`: each sample's own stream from
``(seed, step, i)``, the global generators seeded for it where the dataset draws
from them), collates it and digests its samples for the ledger, so the batches and
the exactly-once record are those of ``loader_workers=0``. An error of the
dataset or the collate comes back with its sample, and is raised as the worker's.

The worker's own generators are never drawn from: the ``DataLoader``'s base seed
comes from a generator of its own. The processes end when :meth:`LoaderProcesses.close`
drops the loader (torch shuts its workers down then), and, when the worker dies,
by torch's watchdog (each exits once its parent is gone, within seconds).
"""

from __future__ import annotations

import pickle
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from planaria.data.integrity import sample_digest
from planaria.data.randomness import serve_samples
from planaria.faults.errors import InfrastructureError

__all__ = ["Chunk", "LoaderProcesses", "SeededSamples"]


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """One micro-batch as a loader process returns it: the batch and its samples' digests,
    or the error the dataset (``what="dataset[i]"``) or the collate raised."""

    batch: Any = None
    digests: tuple[int, ...] = ()
    error: BaseException | None = None
    what: str = ""

    def unwrap(self) -> tuple[Any, tuple[int, ...]]:
        """``(batch, digests)``, or the error raised here (its sample, ``planaria_sample``,
        kept), with the loader process's traceback as a note."""
        if self.error is not None:
            raise self.error
        return self.batch, self.digests


def _portable(err: BaseException, what: str) -> BaseException:
    """``err`` as it can cross to the worker: itself if it pickles, else a RuntimeError
    that names it; with the loader process's traceback as a note."""
    text = traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(err))
        out = err
    except Exception:
        out = RuntimeError(f"{type(err).__name__}: {err}")
        sample = getattr(err, "planaria_sample", None)
        if sample is not None:
            out.planaria_sample = sample  # type: ignore[attr-defined]
    out.add_note(f"(planaria: {what} in a loader process)\n{text}")
    return out


class SeededSamples:
    """The dataset as the loader processes serve it: ``__getitems__`` takes one
    micro-batch's keys ``(step, i)`` and returns its :class:`Chunk`."""

    def __init__(self, dataset: Any, *, seed: int, reseed: bool,
                 collate: Callable[[list[Any]], Any], digests: bool) -> None:
        self.getitem = dataset.__getitem__
        self.seed, self.reseed, self.collate, self.digests = seed, reseed, collate, digests

    def __getitem__(self, key: tuple[int, int]) -> Chunk:
        return self.__getitems__([key])

    def __getitems__(self, keys: list[tuple[int, int]]) -> Chunk:
        step, ids = keys[0][0], [i for _, i in keys]
        try:
            samples = serve_samples(self.seed, step, self.getitem, ids, self.reseed)
        except Exception as err:
            return Chunk(error=_portable(err, "dataset[i]"), what="dataset[i]")
        try:
            batch = self.collate(samples)
        except Exception as err:
            return Chunk(error=_portable(err, "collate"), what="collate")
        digests = tuple(sample_digest(s) for s in samples) if self.digests else ()
        return Chunk(batch=batch, digests=digests)


class StepBatches:
    """The batch sampler: the current share's micro-batches, as ``(step, i)`` keys."""

    def __init__(self) -> None:
        self.step = 0
        self.chunks: list[list[int]] = []

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        step = self.step
        return iter([[(step, i) for i in chunk] for chunk in self.chunks])

    def __len__(self) -> int:
        return len(self.chunks)


def _as_is(chunk: Any) -> Any:
    """The collate_fn: a chunk comes collated from :meth:`SeededSamples.__getitems__`."""
    return chunk


def _default_signals(_worker_id: int) -> None:
    """A loader process does not inherit the worker's SIGTERM handler (a preemption
    notice): torch ends a process that does not stop in time with SIGTERM."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class LoaderProcesses:
    """``processes`` loader processes for one worker's dataset (see module doc)."""

    def __init__(self, name: str, dataset: Any, *, processes: int, seed: int, reseed: bool,
                 collate: Callable[[list[Any]], Any], digests: bool) -> None:
        self.name = name
        self.processes = processes
        self.batches = StepBatches()
        self.loader: DataLoader[Any] | None = DataLoader(
            SeededSamples(dataset, seed=seed, reseed=reseed, collate=collate,
                          digests=digests),  # type: ignore[arg-type]
            batch_sampler=self.batches, num_workers=processes, collate_fn=_as_is,
            persistent_workers=True, multiprocessing_context="fork",
            generator=torch.Generator(), worker_init_fn=_default_signals,
        )
        self.iterator: Iterator[Chunk] | None = None
        self.lock = threading.Lock()  # the loader thread and the training thread take turns

    def start(self) -> None:
        """Forks the processes (nothing loads yet)."""
        with self.lock:
            if self.loader is not None and self.iterator is None:
                self.iterator = iter(self.loader)

    def load(self, step: int, chunks: list[list[int]],
             got: Callable[[list[int]], None]) -> list[Chunk]:
        """The chunks of step ``step``, in order; ``got(chunk)`` as each arrives. A loader
        process that died is the worker's fault (InfrastructureError), not the dataset's."""
        with self.lock:
            if self.loader is None:
                raise InfrastructureError(f"{self.name}: its loader processes are closed")
            self.batches.step, self.batches.chunks = step, chunks
            out: list[Chunk] = []
            try:
                iterator = self.iterator = iter(self.loader)
                for chunk in chunks:
                    out.append(next(iterator))
                    got(chunk)
            except RuntimeError as err:  # torch's: a loader process exited unexpectedly
                raise InfrastructureError(
                    f"{self.name}: a loader process (RunConfig.loader_workers="
                    f"{self.processes}) failed while loading step {step}: {err}",
                    remote_traceback=traceback.format_exc(),
                ) from err
            return out

    def close(self) -> None:
        """Drops the loader: torch shuts its processes down (after a load in flight ends)."""
        self.iterator = self.loader = None
