"""Every key of the controller's store (the TCPStore the job's process groups rendezvous on),
named in one place: who writes each, who reads it.

The controller hosts the store; workers reach it over TCP. Keys are short strings; a
value is a few bytes (a flag, a count, a JSON record) except a run's streamed records
and ledger lines. Each helper returns the exact key; nothing else spells one.
"""

from __future__ import annotations

__all__ = [
    "NOTICES",
    "abort",
    "fence",
    "group_prefix",
    "heartbeat",
    "lifelines",
    "notice",
    "probe",
    "replica_failed",
    "replica_prefix",
    "run_ledger",
    "run_stop",
    "run_stream",
]

NOTICES = "notices"
"""A counter every worker that got a preemption notice bumps (its heartbeat thread); the
controller reads it between waits, one request however many workers there are."""


def heartbeat(worker: str) -> str:
    """``worker``'s heartbeat record (its heartbeat thread writes it; the controller's
    liveness reads it): see planaria.control.liveness."""
    return f"hb/{worker}"


def lifelines() -> str:
    """The address of the controller's lifeline listener (planaria.wire.lifeline): set by
    the controller before its first worker starts; each worker connects to it once."""
    return "lifelines"


def fence(worker: str) -> str:
    """Set by the controller when ``worker`` is fenced off (evicted): the worker refuses
    every call from then on and its heartbeat thread ends it."""
    return f"fence/{worker}"


def abort(gen: int) -> str:
    """Set when generation ``gen``'s step is abandoned (by the controller, or by the worker
    that failed): peers stop waiting in its collectives."""
    return f"abort/{gen}"


def notice(worker: str) -> str:
    """When ``worker`` got its preemption notice (Unix time, written by its heartbeat
    thread)."""
    return f"notice/{worker}"


def probe(worker: str) -> str:
    """The address of ``worker``'s link probe (planaria.control.links)."""
    return f"probe/{worker}"


def run_stop(gen: int, run: int) -> str:
    """Set by the controller to end run ``run`` of generation ``gen`` early (rank 0 reads it
    and the stop rides on the next step's all-reduce)."""
    return f"stop/{gen}/{run}"


def run_stream(gen: int, run: int, chunk: int | None = None) -> str:
    """Rank 0's streamed step records of run ``run``: chunk ``chunk``, or (None) the count."""
    return f"prog/{gen}/{run}/" + ("n" if chunk is None else str(chunk))


def run_ledger(gen: int, run: int, rank: int) -> str:
    """What rank ``rank`` was served in run ``run``, a JSON line per step, appended before
    each step's collective."""
    return f"led/{gen}/{run}/{rank}"


def group_prefix(gen: int, tag: str = "") -> str:
    """The prefix under which generation ``gen``'s process group (``tag``: one of its
    groups, where it has several) rendezvous."""
    return f"gen{gen}/{tag}"


def replica_prefix(replica_key: str) -> str:
    """The prefix of a sharded replica's own keys (its inner group, its failures)."""
    return f"replica/{replica_key}/"


def replica_failed(replica_key: str, index: int) -> str:
    """A sharded replica's worker ``index`` failed on its own (its error, as JSON)."""
    return f"{replica_prefix(replica_key)}failed/{index}"
