"""How long a SIGKILLed process holding gigabytes of torch tensors takes to close its files:
the earliest a lifeline (a pipe or socket the dead worker held) can show its death. Linux
tears down a dying process's memory before it closes its files (do_exit: exit_mm before
exit_files), so the time grows with the memory it held, and with 4 KiB pages more than with
huge ones. Each round starts one process per setting, alternating the order:

- ``plain``: torch's CPU allocator as a worker runs it;
- ``thp``: ``THP_MEM_ALLOC_ENABLE=1``, torch's ``madvise(MADV_HUGEPAGE)`` on allocations of
  2 MiB and more (where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise``): a
  page fault in such a region may compact memory first (``defrag``: ``madvise``);
- ``collapse``: made as ``plain``, then ``madvise(MADV_COLLAPSE)`` (Linux 6.1) on the whole
  2 MiB ranges of each tensor, once built (the kernel copies them into huge pages);
- ``holder``: as ``plain``, in a process that first started planaria's memory holder
  (``planaria.worker.forkserver.start_memory_holder``: a process sharing its memory), as
  a forked CPU worker does; the holder is killed after the EOF.

The lifeline is a Unix socket the process connects to once its tensors are made (after
its holder: a holder keeps a copy of the descriptors open when it starts). ``--busy N``
runs N busy loops meanwhile (a node whose cores train: 3 on the 2-core machine).

Per process: the time to allocate and touch the tensors, to collapse them (``collapse``),
how much of them huge pages hold (``AnonHugePages``), and kill -> the pipe's EOF. Medians
over the rounds; the last line is one JSON object.

    python bench/death_teardown.py --gb 3 --rounds 4 --save bench/results/death_teardown.json
    python bench/death_teardown.py --gb 1.8 --settings plain,holder --busy 3 --rounds 6
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from bench import records  # noqa: E402

CHILD = r"""
import ctypes, os, socket, sys, time, torch
gb, collapse = float(sys.argv[1]), sys.argv[3] == "collapse"
if sys.argv[3] == "holder":
    from planaria.worker import forkserver
    os.setsid()  # a group of its own, killed with its holder
    if forkserver.start_memory_holder() is None:
        raise SystemExit("no memory holder here (x86-64 Linux with glibc only)")
n = int(gb * (1 << 30) / 4 / 64)
t = time.perf_counter()
ts = [torch.ones(n) for _ in range(64)]  # 64 tensors, every page touched
alloc = time.perf_counter() - t
t = time.perf_counter()
if collapse:
    libc, page = ctypes.CDLL(None, use_errno=True), 1 << 21  # a huge page: 2 MiB
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for x in ts:
        lo = -(-x.data_ptr() // page) * page
        hi = (x.data_ptr() + x.nbytes) // page * page
        if hi > lo and libc.madvise(lo, hi - lo, 25) != 0:  # MADV_COLLAPSE
            raise OSError(ctypes.get_errno(), "madvise(MADV_COLLAPSE)")
collapsed = time.perf_counter() - t
huge = [l for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")]
print(alloc, collapsed, huge[0].split()[1] if huge else "-1", flush=True)
lifeline = socket.socket(socket.AF_UNIX)
lifeline.connect(sys.argv[2])
lifeline.sendall(b"x")
time.sleep(600)
"""


SETTINGS = ("plain", "thp", "collapse", "holder")


def one(gb: float, setting: str, address: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting == "thp":
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(_REPO / "src"), env.get("PYTHONPATH", "")])
    server = socket.socket(socket.AF_UNIX)
    server.bind(address)
    server.listen(1)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(gb), address, setting],
                            env=env, stdout=subprocess.PIPE, text=True)
    try:
        server.settimeout(600)
        conn, _ = server.accept()
        if conn.recv(1) != b"x":
            raise RuntimeError("the child died before its tensors were made")
        assert proc.stdout is not None
        alloc, collapsed, huge_kb = proc.stdout.readline().split()
        start = time.perf_counter()
        os.kill(proc.pid, signal.SIGKILL)
        while conn.recv(1 << 12):
            pass
        eof = time.perf_counter() - start
        conn.close()
    finally:
        proc.kill()
        proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the holder (setting "holder")
        server.close()
        os.unlink(address)
    return {"alloc_s": float(alloc), "collapse_s": float(collapsed),
            "huge_mb": int(huge_kb) / 1024, "kill_to_eof_s": eof}


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--gb", type=float, default=3.0, help="tensor memory a process holds")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"which of {','.join(SETTINGS)}, alternating")
    p.add_argument("--busy", type=int, default=0, help="busy loops beside the kills")
    p.add_argument("--save", default=None, metavar="PATH",
                   help="also write the record (commit, command, machine, result) to PATH")
    args = p.parse_args()
    load_before = os.getloadavg()
    thp_mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    defrag = Path("/sys/kernel/mm/transparent_hugepage/defrag")
    settings = tuple(args.settings.split(","))
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        p.error(f"unknown settings {sorted(unknown)}: choose among {','.join(SETTINGS)}")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    address = os.path.join(tempfile.mkdtemp(prefix="death-teardown-"), "lifeline")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    try:
        for i in range(args.rounds):
            for setting in settings if i % 2 == 0 else settings[::-1]:
                runs[setting].append(one(args.gb, setting, address))
    finally:
        for loop in busy:
            loop.kill()
            loop.wait()
        os.rmdir(os.path.dirname(address))
    result: dict[str, object] = {
        "bench": "death_teardown", "gb": args.gb, "rounds": args.rounds, "busy": args.busy,
        "thp_enabled": thp_mode.read_text().strip() if thp_mode.exists() else None,
        "thp_defrag": defrag.read_text().strip() if defrag.exists() else None,
    }
    for name, rows in runs.items():
        for key in ("alloc_s", "collapse_s", "huge_mb", "kill_to_eof_s"):
            values = [round(row[key], 4) for row in rows]
            print(f"{name:8} {key:14} {values}")
            result[f"{name}_{key}"] = values
            result[f"{name}_{key}_median"] = round(statistics.median(values), 4)
    if args.save:
        command = "python bench/death_teardown.py " + " ".join(sys.argv[1:])
        records.save_record(Path(args.save), "death_teardown", result, command,
                            load_before=load_before, load_after=os.getloadavg())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
