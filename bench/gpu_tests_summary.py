"""pytest's summary of the GPU tests as one JSON line (for ``make_benchmarks_md.py``).

    python bench/gpu_tests_summary.py gpu_check_out/gpu_tests.log
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def summarize(log: str) -> dict[str, object]:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    summary = next((line.strip("= ") for line in reversed(lines)
                    if re.search(r"\d+ (passed|failed|error)", line)), "no summary")
    skipped = [m.group(1) for line in lines if (m := re.match(r"SKIPPED \[\d+\] (.*)", line))]
    device = next((m.group(1) for line in lines if (m := re.match(r"device: (.+)", line))), None)
    return {"bench": "gpu_tests", "summary": summary, "skipped": skipped,
            "device": device.strip() if device else None}


if __name__ == "__main__":
    print(json.dumps(summarize(Path(sys.argv[1]).read_text())))
