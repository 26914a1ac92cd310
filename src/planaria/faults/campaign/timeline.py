"""What happened in a run, and when, as the verdict measures it: from the campaign's own
records (``control/fired.jsonl``: the injection's own time; ``control/writes.jsonl``:
when each checkpoint file finished writing) and the event log's timestamps, never from
the runtime's own estimates (``detect_s``, ``recover_s``, ``lost_steps``, ``save_s``).

A *segment* is one incarnation of the job (the event log cut at each ``run_start``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planaria.faults.campaign import oracle, storage_faults

__all__ = ["JOBS_FILE", "Commit", "Timeline"]

JOBS_FILE = "jobs.jsonl"
_SHARD = re.compile(r"step_(\d{9,})/(save-[A-Za-z0-9_-]+)/shard-(\d+)-of-(\d+)\.safetensors$")


@dataclass(frozen=True)
class Commit:
    """A committed step: its segment, step, time (rank 0's commit) and width."""

    segment: int
    step: int
    t: float
    width: int
    duration_s: float


@dataclass
class Timeline:
    """A run's records, indexed for the verdict's measurements."""

    events: list[dict[str, Any]]
    fired: dict[str, dict[str, Any]]
    """Fault id -> its first firing (a fault fired in several processes: the earliest)."""
    writes: list[dict[str, Any]]
    jobs: list[dict[str, Any]] = field(default_factory=list)
    """Per incarnation, as the runner saw its process: ``rc``, ``started_t``, ``ended_t``,
    ``left`` (processes of the run still alive after it, pid -> command)."""

    def __post_init__(self) -> None:
        self.segments = oracle.segments(self.events)
        self.commits = [
            Commit(i, int(r["step"]), float(r["t"]), int(r.get("width") or 0),
                   float(r.get("duration_s") or 0.0))
            for i, seg in enumerate(self.segments) for r in seg
            if r.get("event") == "step_committed"]
        self.commits.sort(key=lambda c: c.t)
        self.pids = {}  # pid -> worker name, per segment
        for i, seg in enumerate(self.segments):
            for r in seg:
                if r.get("event") == "worker_started" and r.get("pid") is not None:
                    self.pids[(i, int(r["pid"]))] = str(r["worker"])

    @classmethod
    def read(cls, run_dir: Path, job_dir: Path) -> Timeline:
        from planaria.observe.events import read_events

        events = read_events(job_dir).events if (job_dir / "events.jsonl").exists() else []
        fired: dict[str, dict[str, Any]] = {}
        for rec in storage_faults.fired(run_dir / "control"):
            fid = rec.get("id")
            if fid is not None and (fid not in fired or rec["t"] < fired[fid]["t"]):
                fired[fid] = rec
        writes = storage_faults.writes(run_dir / "control")
        jobs = storage_faults.read_jsonl(run_dir / JOBS_FILE)
        return cls(events, fired, writes, jobs)

    # ---- steps -------------------------------------------------------------------------------

    def done_before(self, t: float, segment: int) -> int:
        """The steps done at ``t`` in incarnation ``segment``: after its latest commit (or
        restore) before ``t`` (0 in a job started again that has neither yet)."""
        done = 0
        for i, seg in enumerate(self.segments[: segment + 1]):
            if i == segment and i > 0:
                done = 0  # a job started again: from scratch, unless it logs a restore
            for r in seg:
                if i == segment and float(r["t"]) > t:
                    break
                if r.get("event") == "step_committed":
                    done = int(r["step"]) + 1
                elif r.get("event") == "restore" and r.get("step") is not None:
                    done = int(r["step"])
        return done

    def first_commit_after(self, t: float, segment: int | None = None) -> Commit | None:
        for c in self.commits:
            if c.t > t and (segment is None or c.segment >= segment):
                return c
        return None

    def step_length(self, t: float, segment: int) -> float | None:
        """The median step of the last five committed in ``segment`` before ``t``."""
        recent = [c.duration_s for c in self.commits if c.segment == segment and c.t <= t
                  and c.duration_s > 0][-5:]
        if not recent:
            return None
        recent.sort()
        return recent[len(recent) // 2]

    def deadline(self, t: float, segment: int, *, factor: float = 4.0, floor_s: float = 5.0,
                 window: int = 20) -> float:
        """The step deadline at ``t`` as the watchdog defines it (the slowest of the last
        ``window`` steps times ``factor``, at least ``floor_s``), from the committed steps,
        each rescaled to the width at ``t`` as the watchdog rescales them (a rank's share
        of the global batch grows as the width falls)."""
        recent = [c for c in self.commits if c.segment == segment and c.t <= t][-window:]
        width = self.width_at(t, segment)
        scaled = [c.duration_s * (c.width / width if width and c.width else 1.0)
                  for c in recent]
        return max(floor_s, factor * max(scaled, default=0.0))

    def width_at(self, t: float, segment: int) -> int | None:
        """The replicas of the newest generation built in ``segment`` by ``t``."""
        gens = [g for g in self.in_segment(segment, "generation") if float(g["t"]) <= t]
        return len(gens[-1].get("workers") or ()) or None if gens else None

    def members_at(self, t: float, segment: int) -> list[str]:
        """The workers (replicas' leaders) of the newest generation built by ``t``."""
        gens = [g for g in self.in_segment(segment, "generation") if float(g["t"]) <= t]
        return [str(w) for w in gens[-1].get("workers") or ()] if gens else []

    # ---- events ------------------------------------------------------------------------------

    def in_segment(self, segment: int, event: str) -> list[dict[str, Any]]:
        if segment >= len(self.segments):
            return []
        return [r for r in self.segments[segment] if r.get("event") == event]

    def after(self, t: float, event: str) -> list[dict[str, Any]]:
        return [r for r in self.events if r.get("event") == event and float(r["t"]) >= t]

    def worker_of(self, segment: int, pid: int | None) -> str | None:
        return None if pid is None else self.pids.get((segment, int(pid)))

    # ---- checkpoints -------------------------------------------------------------------------

    def saves_written(self) -> list[tuple[int, str, float]]:
        """(step, save, t) of every save whose every shard file finished writing, ``t`` the
        last shard's close (the campaign's own record of faulty://'s writes)."""
        shards: dict[tuple[int, str], dict[int, float]] = {}
        sizes: dict[tuple[int, str], int] = {}
        for w in self.writes:
            m = _SHARD.search(str(w.get("path", "")))
            if m is None:
                continue
            key = (int(m.group(1)), m.group(2))
            shards.setdefault(key, {})[int(m.group(3))] = max(
                float(w["t"]), shards.get(key, {}).get(int(m.group(3)), 0.0))
            sizes[key] = int(m.group(4))
        return sorted((step, save, max(done.values())) for (step, save), done in shards.items()
                      if len(done) == sizes[(step, save)])

    def writers_done_t(self, saved: dict[str, Any]) -> float | None:
        """When the last writer of a committed save finished: the runtime's ``writers_done_t``
        where it gives one, else the last shard's close of the newest save of that step
        written before the commit."""
        if saved.get("writers_done_t") is not None:
            return float(saved["writers_done_t"])
        step, t = int(saved["step"]), float(saved["t"])
        done = [d for s, _, d in self.saves_written() if s == step and d <= t]
        return max(done) if done else None

    def newest_durable(self, t: float, at_most: int | None = None) -> int:
        """The newest step (not past ``at_most``, the steps done then) whose save's writers
        had all finished by ``t`` (0: none): a committed checkpoint, a save whose every
        shard was written, or a restored one."""
        best = 0
        cap = at_most if at_most is not None else 1 << 62
        for r in self.events:
            if float(r["t"]) > t:
                continue
            if r.get("event") == "checkpoint_saved" and int(r["step"]) <= cap:
                done = r.get("writers_done_t")
                if done is None or float(done) <= t:
                    best = max(best, int(r["step"]))
            elif (r.get("event") == "restore" and r.get("step") is not None
                    and int(r["step"]) <= cap):
                best = max(best, int(r["step"]))
        for step, _, done in self.saves_written():
            if done <= t and step <= cap:
                best = max(best, step)
        return best

    def save_started_t(self, saved: dict[str, Any]) -> float | None:
        """When a save's snapshot started: its ``checkpoint_started`` record where the
        runtime writes one, else the save's commit time less its ``save_s``."""
        for r in self.events:
            if (r.get("event") == "checkpoint_started" and r.get("step") == saved.get("step")
                    and r.get("reason") == saved.get("reason") and r["t"] <= saved["t"]):
                return float(r["t"])
        if saved.get("save_s") is None:
            return None
        return float(saved["t"]) - float(saved["save_s"])


def partial_saves(root: Path) -> list[str]:
    """Save directories under a ``faulty://`` checkpoint root that no commit marker names
    (files a failed or abandoned save left behind)."""
    out: list[str] = []
    if not root.is_dir():
        return out
    for step_dir in sorted(root.glob("step_*")):
        if not step_dir.is_dir() or "." in step_dir.name:
            if step_dir.is_dir():
                out.append(str(step_dir))  # a temporary or trash directory left behind
            continue
        named = None
        marker = step_dir / "COMMITTED"
        if marker.exists():
            try:
                named = json.loads(marker.read_text()).get("save_id")
            except (ValueError, OSError, AttributeError):
                named = None
        for save in sorted(step_dir.glob("save-*")):
            if named is None or save.name != f"save-{named}":
                out.append(str(save))
    return out
