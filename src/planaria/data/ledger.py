"""The ledger: an append-only record of the samples every step was served (``ledger.jsonl``).

Two kinds of records, one JSON object a line, never rewritten:

- ``served``: ``run``, ``step``, ``gen``, ``worker``, ``ids`` and, when the
  workers compute them, ``digests`` (crc32 of each sample's content). Written
  for every attempt of a step whose every rank reported, and, for an attempt
  that failed, for each survivor (it reports what it was served when it joins
  the next generation); the ids are those ``dataset[i]`` was called with
  inside the worker (or its loader processes, ``RunConfig.loader_workers``, which
  digest the samples where they decode them), in the order it was called.
- ``commit``: ``run``, ``step``, ``gen`` (and ``skipped: true`` for a step whose
  update was dropped on purpose: a non-finite loss the policy skips). Written
  when the controller commits, or skips.
- ``skip``: ``run``, ``step``, ``samples``, ``reason``: samples left out of every
  step from ``step`` on (a fault of the work that the policy skips).

A step can have several attempts (a failure, a rollback, a run resumed past a
crash); the attempt that counts is the one named by the step's *last* commit
record, found by ``(run, gen)``. A step whose counting record is a skip was
served but trained on nothing: its samples are consumed (the data plan moves
past them) and read as *skipped* (:meth:`Ledger.skipped_records`), never as
trained (:meth:`Ledger.committed_records`), so exactly-once checks count them
apart. A sample served again in a step with another digest than before is
reported to ``on_changed`` (a dataset that is not deterministic: see
:class:`planaria.data.integrity.ServedAgain`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from planaria.data.integrity import ServedAgain
from planaria.observe.append_file import AppendFile

__all__ = ["Ledger"]


class Ledger:
    """Opt-in, append-only record of the samples served to each step (see module doc)."""

    FILE = "ledger.jsonl"

    def __init__(
        self, run_dir: Path, *, run_id: str = "",
        on_changed: Callable[[int, int, str, list[int]], None] | None = None,
    ) -> None:
        """``on_changed(step, gen, worker, ids)``: a record served samples ``ids`` of ``step``
        with other content (digests) than an earlier record of that step."""
        self.path = Path(run_dir) / self.FILE
        self.run_id = run_id
        self._on_changed = on_changed
        self._again = ServedAgain() if on_changed is not None else None
        # A full disk drops records (counted, warned about) instead of stopping the job:
        # an exactly-once check then finds the steps it lacks, and says so.
        self._file = AppendFile(self.path, what="the ledger")

    @property
    def dropped(self) -> int:
        """Records that could not be written (a full disk)."""
        return self._file.dropped

    def served(
        self,
        step: int,
        *,
        gen: int,
        worker: str,
        ids: Sequence[int],
        digests: Sequence[int] | None = None,
    ) -> None:
        entry: dict[str, Any] = {
            "kind": "served",
            "run": self.run_id,
            "step": step,
            "gen": gen,
            "worker": worker,
            "ids": ids,
        }
        if digests:
            entry["digests"] = digests
        self._write(entry)
        if digests and self._again is not None and self._on_changed is not None:
            changed = self._again.observe(step, ids, digests)
            if changed:
                self._on_changed(step, gen, worker, changed)

    def commit(self, step: int, *, gen: int, skipped: bool = False) -> None:
        entry: dict[str, Any] = {"kind": "commit", "run": self.run_id, "step": step, "gen": gen}
        if skipped:
            entry["skipped"] = True
        self._write(entry)

    def skip_samples(self, samples: list[int], *, step: int | None, reason: str) -> None:
        """``samples`` are left out of every step from ``step`` on (a work fault skipped)."""
        self._write({"kind": "skip", "run": self.run_id, "step": -1 if step is None else step,
                     "samples": [int(i) for i in samples], "reason": reason})

    @staticmethod
    def skipped_samples(run_dir: Path) -> dict[int, int]:
        """Sample id → the step from which it was skipped (planaria.control.attribution)."""
        out: dict[int, int] = {}
        for r in Ledger.read(run_dir):
            if r["kind"] == "skip":
                for i in r["samples"]:
                    out.setdefault(int(i), max(0, int(r["step"])))
        return out

    def _write(self, entry: dict[str, Any]) -> None:
        self._file.write_line(json.dumps(entry, separators=(",", ":")))

    def close(self) -> None:
        self._file.close()

    @staticmethod
    def read(run_dir: Path) -> list[dict[str, Any]]:
        """Every record, in the order written (a torn last line is left out)."""
        out: list[dict[str, Any]] = []
        path = Path(run_dir) / Ledger.FILE
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f):
                line = line.strip()
                if not line:
                    continue
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a crash
                if "kind" not in entry:  # an older ledger: one committed record per step
                    entry = {**entry, "run": f"legacy-{n}", "gen": 0, "worker": None}
                    out.append({**entry, "kind": "served"})
                    entry = {k: entry[k] for k in ("run", "step", "gen")} | {"kind": "commit"}
                out.append(entry)
        return out

    @staticmethod
    def _counting(run_dir: Path, *, skipped: bool) -> dict[int, list[dict[str, Any]]]:
        """Step → the served records of the attempt its last commit record names, for the
        steps whose last record is (``skipped``) or is not a skip."""
        records = Ledger.read(run_dir)
        last: dict[int, tuple[Any, Any, bool]] = {}
        for r in records:
            if r["kind"] == "commit":
                last[int(r["step"])] = (r.get("run"), r.get("gen"), bool(r.get("skipped")))
        wanted = {step: key[:2] for step, key in last.items() if key[2] == skipped}
        out: dict[int, list[dict[str, Any]]] = {step: [] for step in wanted}
        for r in records:
            step = int(r["step"])
            if r["kind"] == "served" and wanted.get(step) == (r.get("run"), r.get("gen")):
                out[step].append(r)
        return out

    @staticmethod
    def committed_records(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
        """Trained step → the served records of the attempt that committed it (a skipped
        step is not here: see :meth:`skipped_records`)."""
        return Ledger._counting(run_dir, skipped=False)

    @staticmethod
    def skipped_records(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
        """Skipped step (its update dropped on purpose) → the served records of the attempt
        that was skipped: samples consumed but trained on nothing."""
        return Ledger._counting(run_dir, skipped=True)

    @staticmethod
    def committed(run_dir: Path) -> dict[int, list[int]]:
        """Trained step → the ids its committing attempt was served (in rank order)."""
        return _ids(Ledger.committed_records(run_dir))

    @staticmethod
    def skipped(run_dir: Path) -> dict[int, list[int]]:
        """Skipped step → the ids it was served (consumed, not trained)."""
        return _ids(Ledger.skipped_records(run_dir))


def _ids(records: dict[int, list[dict[str, Any]]]) -> dict[int, list[int]]:
    return {step: [int(i) for r in served for i in r["ids"]] for step, served in records.items()}

