"""Whose fault a failed start or an out-of-memory is: the judges alone, on crafted failures
(no processes)."""

from __future__ import annotations

from planaria.control.attribution import Attribution
from planaria.control.blame import START, judge_raised, judge_start
from planaria.faults.errors import InfrastructureError, OutOfMemory, Work, WorkFault

MISSING = ("the dataset factory raised FileNotFoundError: [Errno 2] No such file or directory: "
           "'/data/train.bin'")
OOM = ("loss raised OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; "
       "79.10 GiB total capacity; 77.02 GiB already allocated)")


def failed(text: str, worker: str = "w0", work: Work | None = None) -> InfrastructureError:
    return InfrastructureError(text, remote_traceback="Traceback ...", workers=(worker,),
                               work=work)


def test_a_start_failing_the_same_way_on_a_second_worker_is_the_users():
    a = Attribution()
    assert judge_start("w0", failed(MISSING), "A", a, started_any=False) is None  # retried
    stop = judge_start("w1", failed(MISSING, "w1"), "B", a, started_any=False)
    assert isinstance(stop, WorkFault) and stop.work == START
    first_line = str(stop).splitlines()[0]
    assert "FileNotFoundError" in first_line and "/data/train.bin" in first_line
    assert stop.workers == ("w0", "w1")


def test_a_restart_of_the_same_worker_counts_as_another_start():
    a = Attribution()
    assert judge_start("w0", failed(MISSING), "A", a, started_any=False) is None
    assert isinstance(judge_start("w0 (start 2)", failed(MISSING), "A", a, started_any=False),
                      WorkFault)


def test_a_start_failure_after_a_worker_started_stays_the_machines():
    """The factories worked on some worker: a node's missing mount, not the user's path."""
    a = Attribution()
    assert judge_start("w2", failed(MISSING, "w2"), "B", a, started_any=True) is None
    assert judge_start("w3", failed(MISSING, "w3"), "B", a, started_any=True) is None


def test_different_failures_at_start_are_not_one_fault():
    a = Attribution()
    assert judge_start("w0", failed(MISSING), "A", a, started_any=False) is None
    other = "the model factory raised OSError: [Errno 28] No space left on device"
    assert judge_start("w1", failed(other, "w1"), "B", a, started_any=False) is None


def test_a_second_out_of_memory_stops_with_the_hint():
    a = Attribution()
    step = Work(step=4, micro_batch=1)
    first = judge_raised(failed(OOM, "w0", step), a, [], width=3)
    assert first is not None and not isinstance(first[0], OutOfMemory)  # retried once
    again = judge_raised(failed(OOM, "w1", Work(step=4, micro_batch=2)), a, [], width=3)
    assert again is not None
    stop = again[0]
    assert isinstance(stop, OutOfMemory) and stop.workers == ("w0", "w1")
    text = str(stop).splitlines()[0]
    assert "micro_batch_size" in text and "workers_per_replica" in text and "bf16" in text


def test_an_out_of_memory_at_start_after_one_in_a_step_stops_too():
    a = Attribution()
    judge_raised(failed(OOM, "w0", Work(step=2, micro_batch=0)), a, [], width=2)
    oom_at_start = OOM.replace("loss raised", "the model factory raised")
    assert isinstance(judge_start("w2", failed(oom_at_start, "w2"), "A", a, started_any=True),
                      OutOfMemory)
