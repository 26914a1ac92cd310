"""Who is to blame for a failure a worker raised: the work it ran (the data or the code
that handles it) or the worker (its process, its node); and the work a fault is about."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planaria.control.attribution import Attribution, Blame, Judgement, Sighting
from planaria.data.plan import micro_batch_range
from planaria.faults.errors import (
    Failure,
    InfrastructureError,
    OutOfMemory,
    Work,
    WorkFault,
    signature,
)
from planaria.faults.user_code import is_out_of_memory

if TYPE_CHECKING:
    from planaria.config import TrainSpec
    from planaria.control.pool import WorkerHandle
    from planaria.data.plan import DataPlan

__all__ = ["START", "away_from", "judge_raised", "judge_start", "samples_of", "signature_of"]

START = Work(what="the worker's start (the model, optimizer and dataset factories)")
"""The work a worker's start runs: a failure there that repeats is the factories'."""

OOM_HINT = ("the job does not fit: lower the micro-batch (TrainSpec.micro_batch_size; the "
            "global batch stays as it is), shard each replica over more workers "
            "(RunConfig.workers_per_replica), or train in lower precision "
            "(TrainSpec.precision='bf16')")


def _out_of_memory(failure: InfrastructureError, attribution: Attribution) -> OutOfMemory | None:
    """A second out-of-memory in the job (any worker, at start or in a step): it stops,
    with what to lower. A first one is retried as any infrastructure error is."""
    if not is_out_of_memory(signature_of(failure)):
        return None
    before = [s for s in attribution.seen() if is_out_of_memory(s.signature)]
    if not before:
        return None
    workers = tuple(dict.fromkeys([*(s.worker for s in before), *failure.workers]))
    return OutOfMemory(
        f"{failure.args[0] if failure.args else failure.kind}; out of memory again (on "
        f"{', '.join(workers)}): {OOM_HINT}",
        remote_traceback=failure.remote_traceback, workers=workers, step=failure.step,
        work=failure.work)


def judge_start(name: str, cause: BaseException, node: str | None, attribution: Attribution,
                *, started_any: bool) -> Failure | None:
    """A worker's start failed with ``cause`` (classified on the worker: a factory's error
    that reads as the machine's, such as an ``OSError``). It is the user's when it repeats
    the same way on another worker, a replacement included, before any worker of the job
    ever started (a factory that worked somewhere is not the fault): a :class:`WorkFault`
    naming the error; a second out-of-memory is :class:`OutOfMemory`. None: the worker's,
    retried."""
    if not isinstance(cause, InfrastructureError):
        return None
    failure = InfrastructureError(str(cause.args[0]) if cause.args else cause.kind,
                                  remote_traceback=cause.remote_traceback, workers=(name,),
                                  work=START)
    oom = _out_of_memory(failure, attribution)
    judgement = attribution.judge(Sighting(name, START, signature_of(failure), node=node),
                                  width=2)
    if oom is not None:
        return oom
    if started_any or judgement.blame is not Blame.WORK:
        return None
    workers = tuple(dict.fromkeys(s.worker for s in judgement.seen))
    return WorkFault(
        f"{failure.args[0]}: it failed the same way on {', '.join(workers)} as they started, "
        "before any worker of the job could: a fault of the factories or of what they read "
        "(a path, a download, the data), not of a machine. Fix it and run again",
        remote_traceback=failure.remote_traceback, workers=workers, work=START)


def judge_raised(failure: Failure, attribution: Attribution, members: list[WorkerHandle],
             width: int) -> tuple[Failure, Judgement | None] | None:
    """Judges a raised infrastructure error (planaria.control.attribution): returns the failure to
    handle (a WorkFault when the work is to blame, the same failure naming only the
    workers to blame otherwise) and the judgement; None for failures it does not judge
    (deaths, hangs, bugs: a hang was judged where it was found)."""
    if not isinstance(failure, InfrastructureError):
        return None
    oom = _out_of_memory(failure, attribution)
    raised = getattr(failure, "raised", None) or [
        (w, failure.work, signature_of(failure)) for w in failure.workers[:1]]
    verdicts: list[tuple[str, Judgement]] = []
    for name, work, sig in raised:
        handle = next((h for h in members if h.name == name), None)
        node = None if handle is None else handle.ray_node
        verdicts.append((name, attribution.judge(
            Sighting(name, work, sig, how="raised", node=node), width=width)))
    if oom is not None:
        return oom, None
    blamed_work = [(n, j) for n, j in verdicts if j.blame is Blame.WORK]
    if blamed_work:
        name, judgement = blamed_work[0]
        seen = judgement.seen
        work = seen[-1].work
        workers = tuple(dict.fromkeys(s.worker for s in seen))
        return WorkFault(
            f"{failure.args[0] if failure.args else failure.kind}: it failed the same way "
            f"on {', '.join(workers)} for {work.describe() if work else 'the same work'}: "
            "a fault of the work (the data or the code that handles it), not of a worker. "
            "Fix or remove it, or set RecoveryPolicy(on_work_fault='skip') to skip its "
            "samples (each skip is recorded in the event log and the ledger)",
            remote_traceback=failure.remote_traceback, workers=workers, step=failure.step,
            work=work,
        ), judgement
    to_blame = [n for n, j in verdicts if j.blame is Blame.WORKER]
    nodes = {j.node for _, j in verdicts if j.blame is Blame.WORKER and j.node}
    to_blame += [h.name for h in members if nodes and h.ray_node in nodes]
    if to_blame:
        failure.workers = tuple(dict.fromkeys(to_blame))
        return failure, next(j for _, j in verdicts if j.blame is Blame.WORKER)
    return failure, verdicts[0][1]


def signature_of(failure: Failure) -> str:
    """The failure's signature (planaria.faults.errors.signature): its message, numbers masked."""
    return signature(str(failure.args[0]) if failure.args else failure.kind)


def away_from(members: list[WorkerHandle], failure: Failure,
              spec: TrainSpec) -> list[WorkerHandle]:
    """The members in an order that gives the failing worker's micro-batch to another one
    (a rotation of the rank order; the same order at width 1 or when the work is unknown)."""
    members = list(members)
    work = failure.work
    name = failure.workers[0] if failure.workers else None
    if len(members) < 2 or work is None or work.micro_batch is None or name is None:
        return members
    total = spec.global_batch_size // spec.micro_batch_size
    for shift in range(1, len(members)):
        order = members[shift:] + members[:shift]
        for rank, handle in enumerate(order):
            first, count = micro_batch_range(total, len(order), rank)
            if first <= work.micro_batch < first + count:
                if handle.name != name:
                    return order
                break
    return members


def samples_of(plan: DataPlan | None, spec: TrainSpec, failure: WorkFault) -> list[int]:
    """The samples a work fault is about: the sample that raised, else its micro-batch's."""
    work = failure.work
    if work is None:
        return []
    if work.sample is not None:
        return [work.sample]
    if work.micro_batch is None or work.step is None or plan is None:
        return []
    mbs = spec.micro_batch_size
    batch = plan.batch(work.step)
    return [int(i) for i in batch[work.micro_batch * mbs:(work.micro_batch + 1) * mbs]]
