"""A Lightning datamodule (or datasets) as a planaria job's data: the training set and its
collate from ``train_dataloader()``, the eval set and its collate from ``val_dataloader()``
(see :mod:`planaria.integrations.lightning`). Needs nothing of Lightning itself."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from planaria.faults.errors import ConfigError

__all__ = ["LightningData", "has_val_dataloader"]

log = logging.getLogger("planaria.integrations.lightning")
_said: set[str] = set()


def _say_once(message: str, *args: Any) -> None:
    if message not in _said:
        _said.add(message)
        log.warning(message, *args)


def _map_style(dataset: Any, where: str) -> Any:
    if isinstance(dataset, IterableDataset) or not (
            hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(
            f"{where} is {type(dataset).__name__}, not a map-style dataset (__len__ and "
            "__getitem__): planaria's exactly-once data plan names every sample by its index; "
            "give a map-style view of the data (or shards of known length indexed as "
            "(shard, offset))")
    return dataset


def has_val_dataloader(datamodule_class: type) -> bool:
    """``datamodule_class`` (a LightningDataModule class) defines ``val_dataloader`` itself
    or in a base of its own (not Lightning's, whose default raises)."""
    for klass in datamodule_class.__mro__:
        if "val_dataloader" in vars(klass):
            return not klass.__module__.startswith(("lightning.", "pytorch_lightning."))
    return False


def _is_factory(data: Any) -> bool:
    return isinstance(data, type) or (callable(data) and not hasattr(data, "__getitem__"))


def _one_loader(loader: Any, hook: str) -> DataLoader[Any]:
    if not isinstance(loader, DataLoader):
        raise ConfigError(
            f"{hook}() returned {type(loader).__name__}: planaria takes one DataLoader over a "
            "map-style dataset (not several loaders)")
    return loader


class LightningData:
    """``TrainSpec.dataset`` and ``collate`` from a datamodule factory, or a dataset (or a
    factory of one) with an optional ``collate_fn``; ``eval_dataset`` and ``eval_collate``
    from the datamodule's ``val_dataloader()`` or ``val_dataset``. In a worker, one
    datamodule serves both (``prepare_data()`` and ``setup("fit")`` once, as Lightning's
    fit does), so a split made in ``setup`` is the same for both."""

    def __init__(self, *, datamodule: Callable[[], Any] | None = None,
                 train_dataset: Any = None, collate_fn: Callable[[list[Any]], Any] | None = None,
                 val_dataset: Any = None) -> None:
        if (datamodule is None) == (train_dataset is None):
            raise ConfigError(
                "datamodule and train_dataset are not valid together: give exactly one, a "
                "LightningDataModule factory or a map-style dataset (or a factory of one)")
        self.datamodule, self.train_dataset, self.collate_fn = (
            datamodule, train_dataset, collate_fn)
        self.val_dataset = val_dataset
        self.val_collate_fn: Callable[[list[Any]], Any] | None = None
        self.built: Any = None  # this process's datamodule, set up (not pickled)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "built": None}

    def set_up(self) -> Any:
        """This process's datamodule, after ``prepare_data()`` and ``setup("fit")``."""
        if self.built is None:
            assert self.datamodule is not None
            datamodule = self.datamodule()
            datamodule.prepare_data()
            datamodule.setup("fit")
            self.built = datamodule
        return self.built

    def val_loader(self) -> DataLoader[Any]:
        return _one_loader(self.set_up().val_dataloader(), "val_dataloader")

    def dataset(self) -> Any:
        if self.datamodule is None:
            data = self.train_dataset
            return _map_style(data() if _is_factory(data) else data, "train_dataset")
        loader = _one_loader(self.set_up().train_dataloader(), "train_dataloader")
        dataset = _map_style(loader.dataset, "train_dataloader().dataset")
        _say_once("train_dataloader(): planaria batches, orders and splits the samples "
                  "itself (the global batch, micro-batches and order of its data plan), so "
                  "the DataLoader's batch_size=%s, sampler=%s (shuffle) and num_workers=%s "
                  "are not used; its dataset and collate_fn are", loader.batch_size,
                  type(loader.sampler).__name__, loader.num_workers)
        if self.collate_fn is None:
            self.collate_fn = loader.collate_fn
        return dataset

    def collate(self, samples: list[Any]) -> Any:
        if self.collate_fn is None:
            raise ConfigError("the Lightning collate ran before its dataset factory")
        return self.collate_fn(samples)

    def eval_dataset(self) -> Any:
        if self.val_dataset is not None:
            data = self.val_dataset
            return _map_style(data() if _is_factory(data) else data, "val_dataset")
        loader = self.val_loader()
        _say_once("val_dataloader(): planaria cuts the eval set into batches by index and "
                  "splits them over the replicas, so the DataLoader's sampler=%s, "
                  "drop_last=%s and num_workers=%s are not used; its dataset, batch_size "
                  "and collate_fn are", type(loader.sampler).__name__, loader.drop_last,
                  loader.num_workers)
        self.val_collate_fn = loader.collate_fn
        return _map_style(loader.dataset, "val_dataloader().dataset")

    def eval_collate(self, samples: list[Any]) -> Any:
        if self.val_collate_fn is None:
            raise ConfigError("the Lightning eval collate ran before its eval dataset factory")
        return self.val_collate_fn(samples)

    def has_eval_set(self) -> bool:
        """``val_dataset`` was given, or the datamodule has a ``val_dataloader()`` (its
        class: the factory, or the type of what it builds here, unset up)."""
        if self.val_dataset is not None:
            return True
        if self.datamodule is None:
            return False
        factory = self.datamodule
        return has_val_dataloader(factory if isinstance(factory, type) else type(factory()))

    def val_batch_size(self) -> int | None:
        """The val loader's ``batch_size``, read from a datamodule built and set up in this
        process (None without a val loader, or when it batches with a batch_sampler)."""
        if self.val_dataset is not None or not self.has_eval_set():
            return None
        probe = LightningData(datamodule=self.datamodule)
        return probe.val_loader().batch_size
