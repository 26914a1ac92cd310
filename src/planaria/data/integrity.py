"""Checks that replicas hold the same data and the same parameters.

- :func:`sample_digest`: a crc32 of one sample's content (tensors, arrays, bytes,
  numbers, strings, nested in tuples, lists and dicts).
- :func:`dataset_fingerprint`: a dataset's length and the digests of a few
  samples at positions drawn from the seed; workers compare it at start and
  when a replacement joins (:func:`describe_mismatch`).
- :func:`divergent_replicas`: which replicas' parameter checksums disagree with
  the majority.
- :class:`ServedAgain`: the samples whose content differs when a step is served
  again (a nondeterministic dataset), from the ledger's digests;
  :func:`describe_global_draws`: what a dataset drawing from the global
  generators costs.
"""

from __future__ import annotations

import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = [
    "Served",
    "ServedAgain",
    "dataset_fingerprint",
    "describe_global_draws",
    "describe_mismatch",
    "divergent_replicas",
    "sample_digest",
]

FINGERPRINT_SAMPLES = 8


def sample_digest(sample: Any) -> int:
    """crc32 of a sample's content, type tags and shapes included."""
    return _digest(sample, 0)


def _digest(obj: Any, crc: int) -> int:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        crc = zlib.crc32(f"T{t.dtype}{tuple(t.shape)}".encode(), crc)
        data: Any = t.view(-1).view(torch.uint8).numpy()
        return zlib.crc32(data, crc)
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            return _digest(obj.tolist(), zlib.crc32(f"A{obj.shape}".encode(), crc))
        a: Any = np.ascontiguousarray(obj)
        crc = zlib.crc32(f"A{a.dtype}{a.shape}".encode(), crc)
        return zlib.crc32(a.view(np.uint8).reshape(-1), crc)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return zlib.crc32(bytes(obj), zlib.crc32(b"B", crc))
    if isinstance(obj, (str, int, float, bool, np.generic)) or obj is None:
        return zlib.crc32(f"S{type(obj).__name__}:{obj!r}".encode(), crc)
    if isinstance(obj, Mapping):
        crc = zlib.crc32(b"D", crc)
        for key in sorted(obj, key=repr):
            crc = _digest(obj[key], _digest(key, crc))
        return crc
    if isinstance(obj, (list, tuple)):
        crc = zlib.crc32(f"L{len(obj)}".encode(), crc)
        for item in obj:
            crc = _digest(item, crc)
        return crc
    tobytes = getattr(obj, "tobytes", None)  # PIL images and the like
    if callable(tobytes):
        return zlib.crc32(tobytes(), zlib.crc32(type(obj).__name__.encode(), crc))
    # Anything else: its type only (a repr may hold a memory address, different everywhere).
    return zlib.crc32(f"O{type(obj).__qualname__}".encode(), crc)


def dataset_fingerprint(
    dataset: Any,
    seed: int,
    get: Callable[[int], Any] | None = None,
    *,
    samples: int = FINGERPRINT_SAMPLES,
) -> dict[str, Any]:
    """``{"num_samples", "positions", "digests"}``: the length and a few samples' digests.

    The positions are drawn from ``seed`` (the same on every worker). ``get``
    fetches one sample (default ``dataset[i]``).
    """
    n = len(dataset)
    rng = np.random.default_rng([seed % 2**32, 0xF1])
    positions = sorted(int(p) for p in rng.choice(n, size=min(samples, n), replace=False))
    fetch = get or dataset.__getitem__
    return {
        "num_samples": int(n),
        "positions": positions,
        "digests": [sample_digest(fetch(p)) for p in positions],
    }


def describe_mismatch(fingerprints: Mapping[str, Mapping[str, Any]]) -> str | None:
    """None if every fingerprint agrees, else a sentence naming who differs and in what."""
    lengths = {name: fp["num_samples"] for name, fp in fingerprints.items()}
    if len(set(lengths.values())) > 1:
        return "dataset length differs: " + _groups(lengths, "samples")
    digests = {name: tuple(fp["digests"]) for name, fp in fingerprints.items()}
    if len(set(digests.values())) <= 1:
        return None
    first = next(iter(fingerprints.values()))
    columns = list(zip(*digests.values(), strict=True))
    where = [p for p, col in zip(first["positions"], columns, strict=True) if len(set(col)) > 1]
    at = {name: digests[name][first["positions"].index(where[0])] for name in digests}
    return (
        f"dataset content differs at sampled positions {where} (same length "
        f"{next(iter(lengths.values()))}); crc32 of sample {where[0]}: "
        + _groups({k: f"{v:08x}" for k, v in at.items()}, "")
    )


def _groups(values: Mapping[str, Any], unit: str) -> str:
    by_value: dict[Any, list[str]] = {}
    for name, value in values.items():
        by_value.setdefault(value, []).append(name)
    suffix = f" {unit}" if unit else ""
    return "; ".join(f"{', '.join(names)}: {value}{suffix}" for value, names in by_value.items())


def divergent_replicas(checksums: Mapping[str, int]) -> tuple[str, ...]:
    """The replicas whose checksum differs from a strict majority's; all of them if none has one."""
    if not checksums:
        return ()
    value, count = Counter(checksums.values()).most_common(1)[0]
    if count * 2 > len(checksums):
        return tuple(name for name, c in checksums.items() if c != value)
    return tuple(checksums) if len(set(checksums.values())) > 1 else ()


@dataclass
class Served:
    """What ``dataset[i]`` was called with in one load, in order, with optional digests."""

    digests_on: bool = False
    ids: list[int] = field(default_factory=list)
    digests: list[int] = field(default_factory=list)

    def extend(self, sample_ids: list[int], samples: list[Any]) -> None:
        self.ids += sample_ids
        if self.digests_on:
            self.digests += [sample_digest(s) for s in samples]

    def add(self, sample_ids: list[int], digests: Sequence[int]) -> None:
        """As :meth:`extend`, the digests computed where the samples were (a loader process)."""
        self.ids += sample_ids
        if self.digests_on:
            self.digests += digests


class ServedAgain:
    """The digests of the samples served recently, by (step, sample id): which ones differ
    when a step is served again (the attempt after a failure, the steps after a restore).

    A sample's content in a step depends only on the dataset, the sample and the step
    (its random stream is :func:`planaria.sample_seed`'s): a digest that changes names a
    dataset that is not deterministic. Memory is bounded: the newest ``keep`` samples
    served (12 bytes each), so a restore further back than that is not checked."""

    def __init__(self, keep: int = 1 << 20) -> None:
        self.keep = keep
        self._steps: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._held = 0

    def observe(self, step: int, ids: Sequence[int], digests: Sequence[int]) -> list[int]:
        """Notes what one record served; returns the ids (in served order, once each)
        served before in ``step`` with another digest."""
        new_ids = np.asarray(ids, dtype=np.int64)
        new_digests = np.asarray(digests, dtype=np.uint32)
        if len(new_ids) != len(new_digests):
            return []  # no digests for this record (or a malformed one): nothing to compare
        known_ids, known_digests = self._steps.pop(step, (new_ids[:0], new_digests[:0]))
        self._held -= len(known_ids)
        changed: list[int] = []
        fresh = np.ones(len(new_ids), dtype=bool)
        if len(known_ids):
            at = np.searchsorted(known_ids, new_ids).clip(max=len(known_ids) - 1)
            seen = known_ids[at] == new_ids
            differ = seen & (known_digests[at] != new_digests)
            changed = list(dict.fromkeys(int(i) for i in new_ids[differ]))
            fresh = ~seen
        # The first serving of a sample is the one others are compared with; a sample twice
        # in one record (a batch straddling two epochs) keeps its first digest.
        add_ids, first = np.unique(new_ids[fresh], return_index=True)
        merged_ids = np.concatenate([known_ids, add_ids])
        merged_digests = np.concatenate([known_digests, new_digests[fresh][first]])
        order = np.argsort(merged_ids, kind="stable")
        self._steps[step] = (merged_ids[order], merged_digests[order])
        self._held += len(merged_ids)
        while self._held > self.keep and len(self._steps) > 1:
            _, (old, _) = self._steps.popitem(last=False)
            self._held -= len(old)
        return changed


def describe_global_draws(drawn: Sequence[str], *, loader_workers: int = 0) -> str:
    """What planaria does for a dataset whose ``dataset[i]`` draws from the global
    generators ``drawn`` (found at setup), and what it costs."""
    names = {"torch": "torch's global generator", "torch.cuda": "torch's CUDA generators",
             "numpy": "numpy's global generator", "random": "Python's random"}
    what = (f"dataset[i] draws from {', '.join(names.get(d, d) for d in drawn)}: every sample is "
            "served with the global generators seeded from its own seed (planaria.sample_seed)")
    if loader_workers:
        return (f"{what}, in the loader processes (RunConfig.loader_workers={loader_workers}), "
                "whose generators are their own: it is the same at any width and through "
                "failures, and the next step loads while this one computes")
    return (
        f"{what} "
        "and the training thread's generators put back after it, so it is the same at any "
        "width and through failures; the global generators are shared by the process's "
        "threads, so samples load on the training thread (no loader thread, whatever "
        "RunConfig.prefetch says). To load in a background thread again, draw from "
        "planaria.sample_generator() instead"
    )
