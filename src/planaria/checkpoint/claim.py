"""A job's claim on its checkpoint root at start: the lease, the lineage it continues
(another run's checkpoints are refused unless the job says what to do with them), the
leftovers of crashed saves, and a probe that every worker reads the root."""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
from collections.abc import Sequence

import ray

from planaria.checkpoint.errors import CheckpointError, OtherRunCheckpoints
from planaria.checkpoint.finished import commit_finished_saves
from planaria.checkpoint.host import EventSink, Member
from planaria.checkpoint.restore import CheckpointInfo
from planaria.checkpoint.retention import clean_leftovers, delete_checkpoint
from planaria.checkpoint.root import CheckpointRoot

__all__ = ["claim_root", "probe_root", "refuse_other_runs"]

_log = logging.getLogger("planaria.checkpoint")


def claim_root(root: CheckpointRoot, members: Sequence[Member], log: EventSink) -> None:
    """Takes the lease on the root, settles this run's lineage (``root.lineage``), removes
    leftovers of crashed saves and probes the root from every member; logs
    ``checkpoint_lineage``. On any error the lease is released again."""
    config = root.config
    prev = root.call(root.lease.acquire, "taking the lease on the root")
    try:
        if config.resume and prev is not None:
            # Saves the previous controller's writers finished but it did not commit.
            for step in commit_finished_saves(root.root, run_ids=set(prev.lineage),
                                              storage_options=root.options):
                log.emit("checkpoint_adopted", step=step, root=root.root)
        removed = clean_leftovers(root.root, storage_options=root.options)
        if removed:
            _log.info("removed leftovers of unfinished saves: %s", removed)
        committed = root.committed()
        runs = {c.step: root.run_of(c) for c in committed}
        mode = "resume"
        if config.resume:
            parent = prev.lineage if prev is not None else tuple(dict.fromkeys(runs.values()))
        else:
            parent, mode = (), config.on_other_run
            if committed and mode == "refuse":
                refuse_other_runs(root, committed, runs)
            if committed and mode == "overwrite":
                st = root.storage()
                for c in committed:
                    delete_checkpoint(st, c)
        root.lineage = (*(r for r in parent if r != root.run_id), root.run_id)
        root.lease.set_lineage(root.lineage)
        root.lease.start_heartbeat()  # stopped by release
        probe_root(root, members)
    except BaseException:
        with contextlib.suppress(Exception):
            root.lease.release()
        raise
    log.emit("checkpoint_lineage", run_id=root.run_id, lineage=list(root.lineage),
             mode=mode, root=root.root,
             other_runs=sorted({str(r) for r in runs.values()} - set(map(str, parent)))
             if mode == "branch" else [])


def probe_root(root: CheckpointRoot, members: Sequence[Member]) -> None:
    """Checks that every member reads what the controller writes under the root (a local
    path is not shared between nodes); :class:`CheckpointError` naming those that do not."""
    st = root.storage()
    name = f"PROBE-{root.run_id}"
    data = secrets.token_bytes(64)
    root.call(functools.partial(st.write_bytes, st.path(name), data),
              "writing the start-up probe")
    try:
        refs = {h.name: h.actor.ckpt_probe.remote(root.root, name, root.options, len(data))
                for h in members}
        results = dict(zip(refs, ray.get(list(refs.values()), timeout=root.config.timeout_s),
                           strict=True))
    finally:
        with contextlib.suppress(OSError):
            st.remove(st.path(name))
    bad = {n: r.error for n, r in results.items() if r.error is not None}
    if bad:
        raise CheckpointError(
            f"checkpoint root {root.root} is not readable from every worker ("
            + "; ".join(f"{n}: {e}" for n, e in sorted(bad.items()))
            + "): use storage every node reaches (a shared file system, s3://, gs://)"
        )


def refuse_other_runs(root: CheckpointRoot, committed: list[CheckpointInfo] | None = None,
                      runs: dict[int, str | None] | None = None) -> None:
    """Raises :class:`OtherRunCheckpoints`, the refusal a run that does not resume meets
    with ``on_other_run="refuse"``, when ``root`` holds committed checkpoints (``committed``
    and ``runs``, each one's run by step: the root's, when the caller has read them). Also
    checked before a job starts anything (``planaria run``), so that the refusal comes
    before Ray and the workers start."""
    committed = root.committed() if committed is None else committed
    if committed:
        runs = {c.step: root.run_of(c) for c in committed} if runs is None else runs
        raise OtherRunCheckpoints(_other_runs_message(root.root, committed, runs))


def _other_runs_message(where: str, committed: list[CheckpointInfo],
                        runs: dict[int, str | None]) -> str:
    by_run: dict[str, list[int]] = {}
    for c in committed:
        by_run.setdefault(str(runs[c.step] or "unnamed (older planaria)"), []).append(c.step)
    held = "; ".join(f"run {r}: steps {', '.join(map(str, s[-5:]))}"
                     + (f" and {len(s) - 5} older" if len(s) > 5 else "")
                     for r, s in by_run.items())
    return (
        f"checkpoint root {where} holds {len(committed)} checkpoints of other runs "
        f"({held}) and this run does not resume (--no-resume): resume them (drop "
        "--no-resume), delete them (CheckpointConfig(on_other_run='overwrite'), "
        "--checkpoint-on-other-run overwrite) or keep them and start a separate lineage "
        "beside them (on_other_run='branch'); or give this run another root"
    )
