"""The ledger: an append-only record of the samples every step was served (``ledger.jsonl``).

Two kinds of records, one JSON object a line, never rewritten:

- ``served``: ``run``, ``step``, ``gen``, ``worker``, ``ids`` and, when the
  workers compute them, ``digests`` (crc32 of each sample's content). Written
  for every attempt of a step whose every rank reported, and, for an attempt
  that failed, for each survivor (it reports what it was served when it joins
  the next generation); the ids are those ``dataset[i]`` was called with
  inside the worker, in the order it was called.
- ``commit``: ``run``, ``step``, ``gen`` (and ``skipped`` for a step whose
  update was dropped on purpose). Written when the controller commits.

A step can have several attempts (a failure, a rollback, a run resumed past a
crash); the attempt that counts is the one named by the step's *last* commit
record, found by ``(run, gen)``. A sample served again in a step with another
digest than before is reported to ``on_changed`` (a dataset that is not
deterministic: see :class:`planaria.integrity.ServedAgain`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planaria.integrity import ServedAgain

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
        torn = self.path.exists() and self.path.stat().st_size > 0 and not _ends_line(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        if torn:  # a crash mid-write: end the partial line so the next record stays whole
            self._file.write("\n")

    def served(
        self,
        step: int,
        *,
        gen: int,
        worker: str,
        ids: list[int],
        digests: list[int] | None = None,
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

    def _write(self, entry: dict[str, Any]) -> None:
        self._file.write(json.dumps(entry, separators=(",", ":")) + "\n")
        self._file.flush()

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
    def committed_records(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
        """Committed step → the served records of the attempt that committed it."""
        records = Ledger.read(run_dir)
        last: dict[int, tuple[Any, Any]] = {}
        for r in records:
            if r["kind"] == "commit":
                last[int(r["step"])] = (r.get("run"), r.get("gen"))
        out: dict[int, list[dict[str, Any]]] = {step: [] for step in last}
        for r in records:
            step = int(r["step"])
            if r["kind"] == "served" and last.get(step) == (r.get("run"), r.get("gen")):
                out[step].append(r)
        return out

    @staticmethod
    def committed(run_dir: Path) -> dict[int, list[int]]:
        """Committed step → the ids its committing attempt was served (in rank order)."""
        return {
            step: [int(i) for r in served for i in r["ids"]]
            for step, served in Ledger.committed_records(run_dir).items()
        }


def _ends_line(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"
