"""Inside the workers: the campaign's wrapper around the spec's dataset.

:class:`CampaignData` replaces the spec's dataset factory; what the workers
build is a :class:`CampaignDataset`, which serves the spec's samples and:

- records every sample each process loaded for a training step, one line
  ``STEP ID`` appended to ``CONTROL/loads-<pid>.txt`` as it is loaded (a plain
  ``write`` on an ``O_APPEND`` file: it survives a SIGKILL of the process a
  moment later). A run on the user's defaults (no ledger) is judged
  exactly-once from these records and the final weights;
- serves the sample faults the injector arms in ``CONTROL/samples.json``: a
  ``raise`` sample's ``__getitem__`` raises ``OSError(EIO)`` every time from
  its ``from_step`` on (a missing shard, a truncated image); a ``sleep`` sample
  sleeps ``sleep_s`` once, in the first load from ``from_step`` on (whichever
  process takes its token, ``CONTROL/sample-<fault id>.token``, an atomic
  rename);
- optionally serves only the first ``limit`` samples (a small dataset, so that
  short runs cross an epoch boundary).

Only loads for a training step (``step >= 0``, read from the sample scope
planaria sets around every ``dataset[i]``) are recorded or faulted: the
fingerprint loads at a worker's setup (step -1) are left alone, so that a
replacement can start while a sample is bad.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planaria.faults.campaign import storage_faults

__all__ = ["LOADS_PREFIX", "SAMPLES_FILE", "CampaignData", "CampaignDataset", "arm_sample",
           "read_loads"]

SAMPLES_FILE = "samples.json"
LOADS_PREFIX = "loads-"
SAMPLE_ACTIONS = ("raise", "sleep")


def _loading_step() -> int | None:
    """The step whose sample this thread loads now (planaria's sample scope), or None."""
    from planaria.data.randomness import current_sample

    key = current_sample()
    return None if key is None else int(key[1])


def arm_sample(
    control: str | Path, *, fault_id: str, sample: int, action: str, from_step: int,
    sleep_s: float = 0.0,
) -> None:
    """Arms a sample fault (see the module docstring); armed faults accumulate."""
    if action not in SAMPLE_ACTIONS:
        raise ValueError(f"action={action!r} is not valid: one of {', '.join(SAMPLE_ACTIONS)}")
    control = Path(control)
    path = control / SAMPLES_FILE
    armed = json.loads(path.read_text()) if path.exists() else []
    armed.append({"id": fault_id, "sample": int(sample), "action": action,
                  "from_step": int(from_step), "sleep_s": float(sleep_s)})
    if action == "sleep":
        (control / f"sample-{fault_id}.token").write_text("")
    tmp = control / f".{SAMPLES_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(armed))
    os.replace(tmp, path)


def read_loads(control: str | Path) -> list[tuple[int, int, int]]:
    """Every ``(pid, step, sample)`` load the workers recorded (a torn last line left out)."""
    out = []
    for path in sorted(Path(control).glob(f"{LOADS_PREFIX}*.txt")):
        pid = int(path.stem.removeprefix(LOADS_PREFIX))
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and all(p.lstrip("-").isdigit() for p in parts):
                out.append((pid, int(parts[0]), int(parts[1])))
    return out


class CampaignData:
    """The spec's dataset factory, wrapped (picklable: it travels in the spec)."""

    def __init__(self, factory: Callable[[], Any], *, control: str | None,
                 limit: int | None = None) -> None:
        self.factory = factory
        self.control = control
        self.limit = limit

    def __call__(self) -> CampaignDataset:
        return CampaignDataset(self.factory(), control=self.control, limit=self.limit)


class CampaignDataset:
    """The spec's dataset, its loads recorded and its armed sample faults served."""

    def __init__(self, inner: Any, *, control: str | None, limit: int | None = None) -> None:
        self.inner = inner
        self.control = control
        self.limit = limit
        self._fd: int | None = None
        self._fd_pid = -1
        self._armed: dict[int, list[dict[str, Any]]] = {}
        self._armed_key: tuple[int, int] | None = None
        self._logged: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner, "control": self.control, "limit": self.limit}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["inner"], control=state["control"], limit=state["limit"])  # type: ignore[misc]

    def __len__(self) -> int:
        n = len(self.inner)
        return n if self.limit is None else min(n, self.limit)

    def __getitem__(self, i: int) -> Any:
        step = _loading_step() if self.control is not None else None
        if step is None or step < 0:
            return self.inner[i]
        for fault in self._faults(int(i)):
            if step >= fault["from_step"]:
                self._serve_fault(fault, int(i), step)
        sample = self.inner[i]
        self._record(f"{step} {int(i)}\n")
        return sample

    # ---- faults ------------------------------------------------------------------------------

    def _faults(self, i: int) -> list[dict[str, Any]]:
        assert self.control is not None
        try:
            st = os.stat(os.path.join(self.control, SAMPLES_FILE))
        except FileNotFoundError:
            return []
        key = (st.st_mtime_ns, st.st_size)
        if key != self._armed_key:
            try:
                with open(os.path.join(self.control, SAMPLES_FILE)) as f:
                    armed = json.load(f)
            except (FileNotFoundError, json.JSONDecodeError):
                return []
            self._armed = {}
            for fault in armed:
                self._armed.setdefault(int(fault["sample"]), []).append(fault)
            self._armed_key = key
        return self._armed.get(i, [])

    def _serve_fault(self, fault: dict[str, Any], i: int, step: int) -> None:
        assert self.control is not None
        fid = str(fault["id"])
        if fault["action"] == "raise":
            if fid not in self._logged:  # once per process: the first raise is the fault's time
                self._logged.add(fid)
                storage_faults.log_fired(self.control, {"id": fid, "action": "bad_sample",
                                                        "sample": i, "step": step})
            raise OSError(errno.EIO, f"injected: sample {i} cannot be read", f"sample-{i}")
        token = os.path.join(self.control, f"sample-{fid}.token")
        try:
            os.rename(token, f"{token}.taken")  # one load in one process sleeps
        except FileNotFoundError:
            return
        storage_faults.log_fired(self.control, {"id": fid, "action": "slow_sample", "sample": i,
                                                "step": step, "sleep_s": fault["sleep_s"]})
        time.sleep(float(fault["sleep_s"]))

    # ---- the load record ---------------------------------------------------------------------

    def _record(self, line: str) -> None:
        assert self.control is not None
        pid = os.getpid()
        if self._fd is None or self._fd_pid != pid:
            path = os.path.join(self.control, f"{LOADS_PREFIX}{pid}.txt")
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._fd_pid = pid
        os.write(self._fd, line.encode())
