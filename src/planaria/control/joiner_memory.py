"""The controller's side of the joiners' shared-memory regions (planaria.worker.memory_reserve):
the job's tag, the nodes its joiners claimed regions on, and their removal at its end."""

from __future__ import annotations

import logging
import uuid

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from planaria.worker import memory_reserve

__all__ = ["JoinerMemory"]

_log = logging.getLogger(__name__)


class JoinerMemory:
    """One job's regions: ``tag`` names them; :meth:`sweep` removes them on every node
    :meth:`note` was told of (a worker started there with ``RunConfig.joiner_memory_reserve``)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tag = uuid.uuid4().hex[:12]
        self.nodes: set[str | None] = set()

    def claimed(self) -> str | None:
        """The tag a starting worker claims its region under (None: no region for it). Every
        worker claims one, a joiner for the state it is sent, the others for the state
        their first step makes: whichever dies leaves it to the next joiner on its node."""
        if not self.enabled:
            return None
        self.nodes.add(None)  # its node is known once it is ready: this one at least
        return self.tag

    def note(self, ray_node: str | None) -> None:
        """A worker that claimed a region is ready on ``ray_node``."""
        self.nodes.add(ray_node)

    def sweep(self, wait_s: float = 5.0) -> None:
        """Removes the job's regions: on this node here, on the others by a task pinned to
        each (bounded by ``wait_s``; a node that does not answer keeps its regions)."""
        if not self.nodes:
            return
        memory_reserve.sweep(self.tag, wait_s)
        here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        remote = [n for n in self.nodes if n is not None and n != here]
        self.nodes.clear()
        refs = []
        for node in remote:
            strategy = NodeAffinitySchedulingStrategy(node, soft=False)
            refs.append(_sweep_there.options(scheduling_strategy=strategy).remote(
                self.tag, wait_s))
        if refs:
            _, missing = ray.wait(refs, num_returns=len(refs), timeout=wait_s + 10.0)
            if missing:
                _log.warning("%d node(s) did not remove the job's shared-memory regions "
                             "(/dev/shm/planaria-reserve-*-%s-*)", len(missing), self.tag)

    def sweep_left_here(self, wait_s: float = 5.0) -> None:
        """Removes the job's regions left on this node (run again after the job's processes
        were killed: a worker orphaned by a dead raylet held its region at :meth:`sweep`)."""
        if self.enabled:
            memory_reserve.sweep(self.tag, wait_s)


@ray.remote(num_cpus=0)
def _sweep_there(tag: str, wait_s: float) -> int:
    return memory_reserve.sweep(tag, wait_s)
