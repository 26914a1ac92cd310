"""Whose fault is a failure: the work's (a sample, a micro-batch, a factory) or the worker's?

A raised error or a hang names neither by itself. An ``OSError`` from ``dataset[i]`` may
be a truncated file (the sample's fault: every worker that loads it fails) or a storage
mount missing on one node (that node's: every sample fails there, nowhere else); a
micro-batch that outlives its deadline may be a hung device or a long sequence. What
tells them apart is where the failure goes next, so the controller moves the work and
watches (:class:`Attribution`, one per job, fed every raised error and hang it sees):

- a failure that follows the same work (the same sample, or micro-batch of a step, or
  factory) to another worker, the same way (:func:`planaria.faults.errors.signature`: type and
  message, numbers masked), is the **work's**; so is a hang at a work where another
  worker hung before (its deadline was doubled meanwhile). A work fault evicts no one:
  the job stops with a save and an error naming the work (``WorkFault``), or, where the
  user opts in, skips its samples and goes on;
- a failure that stays with a worker (or its node) over different work, the same way, is
  the **worker's** (the node's): it is evicted, with the other workers of that node;
- a first failure of its kind is neither yet: the work is **retried elsewhere**, on
  another worker of the same generation, without evicting anyone (a width-1 job retries
  in place; a second identical failure there evicts the worker, and its replacement
  failing the same way again makes it the work's);
- a first hang is the worker's (a thread stuck for good cannot be reused), and the work's
  deadline doubles for whoever runs it next.

Deaths (a process or node gone) are always the worker's: they are not fed here.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from planaria.faults.errors import Work

__all__ = ["Attribution", "Blame", "Judgement", "Sighting"]

HISTORY = 256
"""Sightings kept (a job that fails this often stops on its failure budget first)."""


class Blame(enum.Enum):
    RETRY = "retry"
    """First of its kind: run the work elsewhere (or, at width 1, again), evict no one."""
    WORKER = "worker"
    """The worker's (or its node's): evict it."""
    WORK = "work"
    """The work's: evict no one; stop, or skip the work's samples."""


@dataclass(frozen=True)
class Sighting:
    """One failure of one worker: ``how`` is ``"raised"`` or ``"hung"``."""

    worker: str
    work: Work | None
    signature: str
    how: str = "raised"
    node: str | None = None
    t: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Judgement:
    blame: Blame
    reason: str
    seen: tuple[Sighting, ...] = ()
    """The sightings the judgement rests on, this one last."""
    node: str | None = None
    """With ``WORKER``: the node whose workers go, when the failure follows the node."""


class Attribution:
    """The job's record of failures, and the judge of each new one (see the module doc)."""

    def __init__(self) -> None:
        self._seen: deque[Sighting] = deque(maxlen=HISTORY)
        self._hung_at: dict[tuple[object, ...], int] = {}
        self._work_signatures: set[str] = set()  # signatures some work was blamed for

    def seen(self) -> tuple[Sighting, ...]:
        """The failures recorded so far, oldest first."""
        return tuple(self._seen)

    def patience(self, work: Work | None) -> float:
        """The factor on ``work``'s deadline: doubled for every worker that hung on it."""
        if work is None:
            return 1.0
        return float(2 ** self._hung_at.get(work.key, 0))

    def judge(self, s: Sighting, *, width: int) -> Judgement:
        """Records ``s`` and says whose fault it is. ``width``: live replicas, ``s``'s
        worker among them."""
        prior = list(self._seen)
        self._seen.append(s)
        key = s.work.key if s.work is not None else None
        if s.how == "hung" and key is not None:
            self._hung_at[key] = self._hung_at.get(key, 0) + 1
        same_work = [p for p in prior if key is not None and p.work is not None
                     and p.work.key == key and p.worker != s.worker and p.how == s.how
                     and (p.how == "hung" or p.signature == s.signature)]
        if same_work:
            self._work_signatures.add(s.signature)
            names = ", ".join(sorted({p.worker for p in same_work} | {s.worker}))
            return Judgement(Blame.WORK, f"{s.work.describe() if s.work else 'the work'} "
                             f"failed the same way on {names}", (*same_work, s))
        same_place = [p for p in prior if p.signature == s.signature and p.how == s.how
                      and (p.worker == s.worker or (s.node is not None and p.node == s.node))
                      and (key is None or p.work is None or p.work.key != key)]
        if same_place and s.signature in self._work_signatures and s.how == "raised":
            # Some work already fails this way everywhere: this is likely more such work
            # (another bad sample), not this worker. It goes elsewhere first.
            return Judgement(Blame.RETRY, "fails as work already blamed does: the work runs "
                             "on another worker", (s,))
        if same_place:
            where = f"node {s.node}" if s.node and any(p.worker != s.worker
                                                       for p in same_place) else s.worker
            return Judgement(Blame.WORKER, f"{where} failed the same way on other work",
                             (*same_place, s),
                             node=s.node if where.startswith("node") else None)
        if s.how == "hung":
            return Judgement(Blame.WORKER, f"{s.worker} hung (the work's deadline doubles for "
                             "the next worker on it)", (s,))
        again_here = [p for p in prior if p.worker == s.worker and p.signature == s.signature
                      and key is not None and p.work is not None and p.work.key == key]
        if again_here:
            return Judgement(Blame.WORKER, f"{s.worker} failed the same way on the same work "
                             "twice: a replacement runs it next", (*again_here, s))
        where = "on another worker" if width > 1 else "again"
        return Judgement(Blame.RETRY, f"first failure of its kind: the work runs {where}", (s,))
