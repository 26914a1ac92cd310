"""Written is durable: commit the saves whose writers all finished before their job stopped.

A save's writers keep each shard's record beside it once the shard is written and read
back (``shard-K-of-N.record.json``), and the controller keeps the save's description
beside them (``save.json``: its step, metadata, shard count and run). A save whose every
record is there holds a whole, verified checkpoint even if its writers, or the controller
that would have committed it, died before the commit: the next controller of the root
commits it (:func:`commit_finished_saves`) before it cleans up leftovers, so that a job
killed just after its save was written restores that save, not the one before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from typing import Any

from planaria.checkpoint.commit import commit_checkpoint
from planaria.checkpoint.errors import CheckpointError
from planaria.checkpoint.layout import MARKER, parse_dir_name, step_dir_name
from planaria.checkpoint.storage import Storage
from planaria.checkpoint.writer import RECORD_SUFFIX, SAVE_FILE, ShardRecord

__all__ = ["commit_finished_saves", "written_records"]

_log = logging.getLogger("planaria.checkpoint")


def _save_dirs(st: Storage) -> list[str]:
    """Directories of saves not committed: local temporary directories; on object stores,
    the ``save-*`` prefixes of steps with no marker."""
    out = []
    for name in st.listdir():
        parsed = parse_dir_name(name)
        if parsed is None:
            continue
        if st.local and parsed[1] == "tmp":
            out.append(st.path(name))
        elif not st.local and parsed[1] == "final":
            step_dir = st.path(name)
            if st.exists(f"{step_dir}/{MARKER}"):
                continue
            out += [f"{step_dir}/{sub}" for sub in st.listdir(step_dir)
                    if sub.startswith("save-")]
    return out


def written_records(st: Storage, directory: str, shards: int) -> list[ShardRecord] | None:
    """The records beside the shards of the save in ``directory``, if all ``shards`` of them
    are there (every shard written and read back); None if one is missing."""
    names = [n for n in st.listdir(directory) if n.endswith(RECORD_SUFFIX)]
    if len(names) != shards:
        return None
    return [ShardRecord.from_dict(json.loads(st.read_bytes(f"{directory}/{n}"))) for n in names]


def commit_finished_saves(
    root: str, *, run_ids: Collection[str | None],
    storage_options: Mapping[str, Any] | None = None,
) -> list[int]:
    """Commits every save under ``root`` of a run in ``run_ids`` whose shards all have
    their records beside them and whose step has no committed checkpoint yet; returns
    the steps committed. A save missing a record, or another run's, is left for
    :func:`planaria.checkpoint.clean_leftovers` to remove."""
    st = Storage(root, storage_options)
    committed = []
    for directory in _save_dirs(st):
        try:
            desc = json.loads(st.read_bytes(f"{directory}/{SAVE_FILE}"))
        except (OSError, ValueError):
            continue  # no description: the controller died before it wrote it
        step, run_id = int(desc["step"]), desc.get("run_id")
        if run_id not in run_ids or st.exists(f"{st.path(step_dir_name(step))}/{MARKER}"):
            continue
        try:
            records = written_records(st, directory, int(desc["shards"]))
            if records is None:
                continue  # a writer did not finish: not a whole checkpoint
            path = commit_checkpoint(root, step, records, desc["meta"],
                                     world_size=len(records), storage_options=storage_options,
                                     run_id=run_id)
        except (OSError, ValueError, KeyError, CheckpointError) as err:
            _log.warning("could not commit the finished save in %s: %s", directory, err)
            continue
        _log.warning("committed the save of step %d that its writers finished before the job "
                     "stopped: %s", step, path)
        committed.append(step)
    return committed
