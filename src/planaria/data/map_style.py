"""Why planaria's datasets are map-style, and the check that says so at job start.

Exactly-once data across failures and width changes rests on every sample having
an index: the plan (:class:`planaria.data.plan.DataPlan`) names each step's samples
by index, a step that fails is served again with the same ones, a replica that
joins takes its share by index, and a resumed job starts at a position in the plan.
A stream (``torch.utils.data.IterableDataset``, a Hugging Face
``datasets.IterableDataset``) can do none of that: :func:`check_map_style` refuses
it with the way to a map-style view.
"""

from __future__ import annotations

from typing import Any

from planaria.faults.errors import ConfigError

__all__ = ["MAP_STYLE_WAYS", "check_map_style"]

MAP_STYLE_WAYS = (
    "give TrainSpec.dataset a map-style view: a Hugging Face dataset loaded without "
    "streaming (load_dataset(..., streaming=False)), or a stream materialised once to Arrow "
    "on disk (datasets.Dataset.from_generator(lambda: (yield from stream), "
    "features=stream.features)); for your own stream, shards of known length read as "
    "(shard, offset): torch.utils.data.ConcatDataset of map-style shards finds the shard of "
    "sample i from the shards' lengths"
)


def _is_stream(dataset: Any) -> str | None:
    """The stream class ``dataset`` is an instance of, by name; None for another."""
    from torch.utils.data import IterableDataset

    for cls in type(dataset).__mro__:  # without importing datasets where it is not used
        if cls.__name__ == "IterableDataset" and cls.__module__.startswith("datasets"):
            return "datasets.IterableDataset"  # (a torch IterableDataset too)
    if isinstance(dataset, IterableDataset):
        return "torch.utils.data.IterableDataset"
    return None


def check_map_style(dataset: Any) -> None:
    """Raises ConfigError for a dataset that is not map-style (``__len__`` and
    ``__getitem__(i)``), saying why planaria needs one and the way to one."""
    why = ("exactly-once data across failures and width changes needs every sample "
           "addressable by an index (a failed step is served again with the same samples, a "
           "joining replica takes its share by index, a resumed job starts at a position in "
           "the plan), which a stream cannot replay")
    stream = _is_stream(dataset)
    if stream is not None:
        raise ConfigError(
            f"TrainSpec.dataset built a {stream} ({type(dataset).__qualname__}), not a "
            f"map-style dataset: {why}; {MAP_STYLE_WAYS}"
        )
    missing = [m for m in ("__len__", "__getitem__") if not hasattr(type(dataset), m)]
    if missing:
        raise ConfigError(
            f"TrainSpec.dataset built a {type(dataset).__qualname__} without "
            f"{' and '.join(missing)}: planaria needs a map-style dataset (__len__ and "
            f"__getitem__(i)): {why}; {MAP_STYLE_WAYS}"
        )
