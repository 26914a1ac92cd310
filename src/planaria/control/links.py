"""Which rank cannot be reached, when every rank of a group waits on its peers?

A process-group link can die while its process lives: a NIC, a switch port or a firewall
drops the worker's traffic, yet its heartbeat (another connection, to the controller's
store) stays fresh, and every rank of the group waits "on a peer" in its all-reduce, none
of them stuck in its own work. Only the collective timeout would end that (minutes), and
it names no one. So when every rank has waited on its peers past the step deadline, the
controller looks for the rank that cannot be reached (:func:`find_unreachable`), from
three kinds of evidence:

- **probes**: each worker listens on the address its process group uses
  (:class:`~planaria.wire.probes.ProbeServer`, published in the store under
  ``probe/<name>``); the controller and every rank try to reach every other rank there. A
  rank the others cannot reach is cut off (a dead link drops new connections as well as
  old ones);
- **stalled connections**: each rank reports its own TCP connections that hold unacked
  bytes under retransmission (:func:`~planaria.wire.probes.stalled_connections`, from
  ``/proc/net/tcp``). A rank that is an endpoint of every stalled connection, and of more
  than one, is the one whose traffic is lost (this finds a link that drops established
  flows while new connections pass, at three ranks or more);
- where neither names one rank (two ranks with a flow dropped both ways), no one is
  blamed: the generation is built again, on fresh connections.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from planaria.wire.probes import LinkReport

__all__ = ["Verdict", "find_unreachable"]

_log = logging.getLogger("planaria.control.liveness")

@dataclass(frozen=True)
class Verdict:
    """Whom :func:`find_unreachable` found, and on what evidence."""

    culprits: tuple[str, ...]
    reason: str


def find_unreachable(
    names: list[str],
    controller_reached: Mapping[str, bool],
    reports: Mapping[str, LinkReport],
) -> Verdict:
    """The ranks that cannot be reached (see the module doc). ``controller_reached``: did
    the controller's probe of each rank answer; ``reports``: each rank that answered the
    controller's question, ``{"reached": {peer: bool}, "stalled": [(local, remote), ...],
    "endpoints": [local, ...]}`` (a rank that did not answer is missing)."""
    votes: dict[str, int] = {n: 0 for n in names}
    probers: dict[str, int] = {n: 0 for n in names}
    for name in names:
        if name in controller_reached:
            probers[name] += 1
            votes[name] += not controller_reached[name]
    for report in reports.values():
        for peer, ok in report.reached.items():
            if peer in votes:
                probers[peer] += 1
                votes[peer] += not ok
    cut = [n for n in names if probers[n] and votes[n] * 2 > probers[n]]
    if cut and len(cut) < len(names):
        return Verdict(tuple(cut), "could not be reached by "
                       + ", ".join(f"{n}: {votes[n]} of {probers[n]}" for n in cut))
    # Stalled flows: which rank is an endpoint of every one of them?
    owner: dict[str, str] = {}
    for name, report in reports.items():
        for local in report.endpoints:
            owner[local] = name
    edges: list[frozenset[str]] = []
    for name, report in reports.items():
        for _, remote in report.stalled:
            owner_of_remote = owner.get(remote)
            if owner_of_remote is not None and owner_of_remote != name:
                edges.append(frozenset((name, owner_of_remote)))
    edges = list(dict.fromkeys(edges))
    if len(edges) >= 2:
        common = set.intersection(*(set(e) for e in edges))
        if len(common) == 1:
            culprit = common.pop()
            return Verdict((culprit,), f"an endpoint of every stalled connection ({len(edges)})")
    return Verdict((), "every rank could be reached and no single rank's traffic is lost")
