"""A worker's malloc keeps what a step frees for the next step (process.keep_freed_memory):
a step's allocations on a thread of its own no longer fault their pages in again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from planaria.worker import process

# A step's pattern on a thread of its own (as Ray runs an actor's calls): tensors of mixed
# sizes taken in turn, then freed in reverse (forward, then backward), every iteration.
# Prints the page faults of the iterations after the first.
STEPS = """
import random, resource, sys, threading
import torch
if sys.argv[1] == "keep":
    from planaria.worker.process import keep_freed_memory
    assert keep_freed_memory()
marks = []
def steps():
    sizes = [random.Random(0).randrange(25_000, 800_000) for _ in range(60)]
    for i in range(20):
        if i == 1:
            marks.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        held = [torch.ones(n) for n in sizes]
        while held:
            held.pop()
thread = threading.Thread(target=steps)
thread.start()
thread.join()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - marks[0])
"""


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", STEPS, mode], env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_steps_on_a_thread_stop_faulting_their_memory_in_again() -> None:
    plain, kept = _faults("plain"), _faults("keep")
    assert plain > 10_000, plain  # glibc gives the freed memory back every step
    assert kept * 10 < plain, (kept, plain)


def test_a_threshold_the_user_set_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert process.keep_freed_memory() is False
