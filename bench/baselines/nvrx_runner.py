"""NVIDIA's resiliency extension (NVRx) as a bench peer: DDP under its ``ft_launcher``.

NVRx is not a dependency of the project: it installs into its own environment, e.g.
``python -m venv --system-site-packages /tmp/venv-nvrx && /tmp/venv-nvrx/bin/pip install
nvidia-resiliency-ext``, and the runner is given that environment's Python (``python``);
its ``ft_launcher`` sits beside it. See ``PEERS.md`` for what was checked.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["ft_launcher", "run_nvrx_steady"]

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parents[1]


def ft_launcher(python: str = sys.executable) -> str:
    """NVRx's ``ft_launcher`` beside ``python``; FileNotFoundError (how to install) if absent."""
    launcher = Path(python).parent / "ft_launcher"
    if not launcher.exists():
        raise FileNotFoundError(f"no ft_launcher beside {python}: pip install "
                                "nvidia-resiliency-ext in that environment (see PEERS.md)")
    return str(launcher)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nvrx_steady(
    steps: int,
    size: str = "small",
    nproc: int = 2,
    threads: int = 1,
    *,
    python: str = sys.executable,
    warmup: int = 3,
    heartbeat_timeout_s: float = 20.0,
    timeout_s: float = 300.0,
    workdir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """DDP (``nvrx_train.py``) under ``ft_launcher`` for ``steps`` fault-free steps; rank 0's
    step times. Returns ``{"step_ms_median", "step_ms" (steady steps), "nproc", "size",
    "log", "launcher_log"}``; raises RuntimeError (with the launcher's last lines) if the
    launcher fails."""
    if steps <= warmup:
        raise ValueError(f"steps={steps} must exceed warmup={warmup}")
    wd = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="nvrx_"))
    wd.mkdir(parents=True, exist_ok=True)
    log, out = wd / "nvrx.jsonl", wd / "ft_launcher.log"
    log.unlink(missing_ok=True)  # this run's rows alone (the workdir may be used again)
    cmd = [ft_launcher(python), "--nnodes=1", f"--nproc-per-node={nproc}", "--max-restarts=0",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
           "--monitor-interval=0.1", f"--ft-initial-rank-heartbeat-timeout={timeout_s}",
           f"--ft-rank-heartbeat-timeout={heartbeat_timeout_s}",
           str(_HERE / "nvrx_train.py"), f"--steps={steps}", f"--size={size}",
           f"--threads={threads}", f"--warmup={warmup}", f"--out={log}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(_REPO), os.environ.get("PYTHONPATH"))
                                         if p)}
    with open(out, "wb") as f:
        proc = subprocess.run(cmd, env=env, cwd=_REPO, stdout=f, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        tail = "\n".join(out.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"ft_launcher exited with {proc.returncode}:\n{tail}")
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    step_ms = [r["step_ms"] for r in rows if r["event"] == "step" and not r["warmup"]]
    return {"step_ms_median": statistics.median(step_ms) if step_ms else None,
            "step_ms": step_ms, "nproc": nproc, "size": size, "log": str(log),
            "launcher_log": str(out)}
