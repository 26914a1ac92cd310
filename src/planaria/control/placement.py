"""Workers laid out over the nodes with a Ray placement group (``RunConfig.placement``).

One bundle per worker slot (replicas + spares), each the resources of one worker.
A worker takes a free slot and is scheduled into that bundle; its slot is free
again when it is killed or released. When a node dies, Ray places its bundles
again on the nodes left if they have room (``spread`` and ``pack`` allow two
bundles on a node; ``strict_spread`` never does), else on a node that joins
later: a replacement asked for meanwhile waits in its bundle. A worker started
while every slot is held (a replacement for a worker still draining, fresh
workers started before the old ones are killed) is placed by Ray's scheduler.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from planaria.config import RunConfig
from planaria.faults.errors import ElasticRuntimeError

__all__ = ["Placement"]

_log = logging.getLogger("planaria.membership")

STRATEGIES = {"spread": "SPREAD", "strict_spread": "STRICT_SPREAD", "pack": "PACK"}


class Placement:
    """The job's placement group and which worker holds which of its bundles."""

    def __init__(self, config: RunConfig, *, name: str) -> None:
        assert config.placement is not None
        self.strategy = STRATEGIES[config.placement]
        bundle: dict[str, float] = {"CPU": config.cpus_per_worker}
        if config.use_gpu:
            bundle["GPU"] = 1
        slots = config.replicas + config.spares
        self.bundle = bundle
        self.group = placement_group(
            [dict(bundle) for _ in range(slots)], strategy=self.strategy, name=name
        )
        self.holders: list[str | None] = [None] * slots

    def wait_ready(self, timeout_s: float) -> None:
        """Waits until every bundle is placed; raises ElasticRuntimeError past ``timeout_s``."""
        try:
            ray.get(self.group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            raise ElasticRuntimeError(
                f"the placement group ({len(self.holders)} bundles of {self.bundle}, "
                f"{self.strategy}) could not be placed within {timeout_s:g} s: the cluster "
                "lacks the resources (or, for strict_spread, the nodes) for it"
            ) from err

    def nodes(self) -> list[str | None]:
        """The node id each bundle is on now (None: not placed)."""
        table = placement_group_table(self.group)
        where = table.get("bundles_to_node_id", {})
        return [where.get(i) for i in range(len(self.holders))]

    def options(self, worker: str) -> dict[str, Any]:
        """Actor options that put ``worker`` in a free bundle (empty when none is free)."""
        try:
            slot = self.holders.index(None)
        except ValueError:
            _log.info("%s starts outside the placement group: every bundle is held", worker)
            return {}
        self.holders[slot] = worker
        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=slot
            )
        }

    def free(self, worker: str) -> None:
        """``worker`` is gone (killed or released): its bundle takes the next worker."""
        for i, holder in enumerate(self.holders):
            if holder == worker:
                self.holders[i] = None

    def remove(self) -> None:
        try:
            ray.util.remove_placement_group(self.group)
        except Exception:  # Ray is going down anyway
            _log.debug("could not remove the placement group", exc_info=True)
