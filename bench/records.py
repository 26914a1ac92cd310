"""What a bench keeps of every run, so that its figures can be computed again without it.

A *raw record* is one run's measurements (its commits, kills, window, configuration,
seed, the machine's load average before and after it, the commit of the tree it ran and
the command line), written to
``<root>/<bench>/<regime>/<commit>/<system>-r<repeat>.json`` (gzipped, ``.json.gz``, when
its JSON passes ``GZIP_OVER_BYTES``). ``root`` is ``bench/results/raw`` unless a bench is
told otherwise (a smoke run writes beside its work). A *summary record* is a bench's
result with the commit, the command, the machine and the load around the whole run
(:func:`save_record`). ``bench/make_benchmarks_md.py --rescore`` recomputes every summary
from the raw records alone.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = [
    "GZIP_OVER_BYTES",
    "RAW_ROOT",
    "commit_dir_name",
    "latest_raw_dir",
    "machine",
    "raw_dir",
    "read_raw",
    "save_record",
    "tree_commit",
    "write_raw",
]

_REPO = Path(__file__).resolve().parents[1]
RAW_ROOT = _REPO / "bench" / "results" / "raw"
GZIP_OVER_BYTES = 1_000_000


def tree_commit(repo: Path = _REPO) -> str | None:
    """``git rev-parse HEAD``, with ``-dirty`` when tracked files differ from it (untracked
    ones do not count); outside a git checkout (a copy of the tree sent to another machine),
    ``PLANARIA_COMMIT`` from the environment, else None."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=repo, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("PLANARIA_COMMIT") or None
    return head + ("-dirty" if dirty.strip() else "")


def commit_dir_name(commit: str | None) -> str:
    """The folder a commit's raw records go to: its first 12 hex digits (``-dirty`` kept)."""
    if not commit:
        return "unknown"
    head, dirty = commit.removesuffix("-dirty"), commit.endswith("-dirty")
    return head[:12] + ("-dirty" if dirty else "")


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {"nproc": os.cpu_count(), "python": platform.python_version()}
    from importlib.metadata import PackageNotFoundError, version

    for mod in ("torch", "ray", "torchft"):
        try:
            info[mod] = version(mod)
        except PackageNotFoundError:
            info[mod] = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
        info["mem_gib"] = round(mem_kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return info


def machine_of(raws: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The machine the raw records ran on, for a summary scored from them: the one they all
    name; where they name several, or some name none (records before machines were kept), its
    ``cpu`` says so and the run lines name each run's."""
    named = [r.get("machine") for r in raws.values()]
    if named and all(m is not None and m == named[0] for m in named):
        return dict(named[0])  # type: ignore[arg-type]
    cpus = sorted({str((m or {}).get("cpu") or "unrecorded") for m in named})
    base = next((m for m in named if m), None) or machine()
    return {**base, "cpu": "several: " + ", ".join(cpus) + " (each run's is listed)"}


def raw_dir(root: Path, bench: str, regime: str, commit: str | None) -> Path:
    """``root/bench/regime/<commit>``: where one bench run's raw records go."""
    return Path(root) / bench / regime / commit_dir_name(commit)


def write_raw(folder: Path, name: str, record: dict[str, Any]) -> Path:
    """Writes ``folder/name.json`` (``.json.gz`` when large); returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, default=str, sort_keys=True)
    plain, packed = folder / f"{name}.json", folder / f"{name}.json.gz"
    if len(text) > GZIP_OVER_BYTES:
        plain.unlink(missing_ok=True)
        with gzip.open(packed, "wt") as f:
            f.write(text)
        return packed
    packed.unlink(missing_ok=True)
    plain.write_text(text + "\n")
    return plain


def read_raw(folder: Path) -> dict[str, dict[str, Any]]:
    """Every raw record in ``folder``, by name (the file name without ``.json[.gz]``)."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(folder).iterdir()):
        if path.name.endswith(".json.gz"):
            with gzip.open(path, "rt") as f:
                out[path.name.removesuffix(".json.gz")] = json.load(f)
        elif path.name.endswith(".json"):
            out[path.name.removesuffix(".json")] = json.loads(path.read_text())
    return out


def latest_raw_dir(root: Path, bench: str, regime: str) -> Path | None:
    """The commit folder of ``root/bench/regime`` whose runs ended last, if any: by the
    records' own end times (``t1``, a goodput run's window), else by the files' times (which
    a fresh clone sets all alike, in no order)."""
    base = Path(root) / bench / regime
    dirs = [d for d in base.iterdir() if d.is_dir()] if base.is_dir() else []
    return max(dirs, key=_written, default=None)


def _written(folder: Path) -> float:
    """When the runs of ``folder`` ended (Unix time): the latest ``t1`` its records carry,
    else its files' latest modification time."""
    ends = [float(r["t1"]) for r in read_raw(folder).values()
            if isinstance(r.get("t1"), int | float)]
    if ends:
        return max(ends)
    return max((p.stat().st_mtime for p in folder.iterdir()), default=folder.stat().st_mtime)


def save_record(path: Path, name: str, result: dict[str, Any], command: str, *,
                when: float | None = None, machine_info: dict[str, Any] | None = None,
                **extra: Any) -> Path:
    """Writes a bench's summary record: ``{"bench", "command", "commit", "date", "machine",
    **extra, "result"}`` (``commit`` from ``extra``, or this checkout's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.fromtimestamp(time.time() if when is None else when, dt.UTC)
    record = {
        "bench": name,
        "command": command,
        "commit": extra.pop("commit", None) or tree_commit(),
        "date": stamp.isoformat(timespec="seconds"),
        "machine": machine_info or machine(),
        **extra,
        "result": result,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
