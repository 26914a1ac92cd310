"""Every process's CPU time (user + system, all its threads) sampled each second: writes a
JSON line per second, ``{"t", "rows": [[pid, comm, nice, seconds], ...]}``, for the
processes that used CPU in that second.

    python cpusample.py OUT.jsonl SECONDS
"""

import json
import os
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def snapshot() -> dict[int, tuple[str, int, int]]:
    """pid -> (comm, nice, CPU ticks so far)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        end = stat.rfind(")")
        fields = stat[end + 2:].split()
        out[int(pid)] = (stat[stat.find("(") + 1:end], int(fields[16]),
                         int(fields[11]) + int(fields[12]))
    return out


def main() -> None:
    path, seconds = sys.argv[1], float(sys.argv[2])
    prev, end = snapshot(), time.time() + seconds
    with open(path, "w") as out:
        while time.time() < end:
            time.sleep(1.0)
            cur, now = snapshot(), time.time()
            rows = [[pid, comm, nice, (ticks - prev.get(pid, (comm, nice, 0))[2]) / HZ]
                    for pid, (comm, nice, ticks) in cur.items()
                    if ticks > prev.get(pid, (comm, nice, 0))[2]]
            out.write(json.dumps({"t": now, "rows": rows}) + "\n")
            out.flush()
            prev = cur


if __name__ == "__main__":
    main()
