"""The work's fault or the worker's: the judge alone, on crafted sightings (no processes)."""

from __future__ import annotations

from planaria.control.attribution import Attribution, Blame, Sighting
from planaria.faults.errors import Work, signature


def sig(text: str) -> str:
    return signature(text)


def test_a_failure_that_follows_a_sample_to_another_worker_is_the_works():
    a = Attribution()
    bad = Work(step=3, micro_batch=1, sample=17)
    first = a.judge(Sighting("w0", bad, sig("OSError: image file is truncated")), width=3)
    assert first.blame is Blame.RETRY
    # The same sample in another step (or epoch), on another worker: the sample is bad.
    again = Work(step=3, micro_batch=0, sample=17)
    second = a.judge(Sighting("w1", again, sig("OSError: image file is truncated")), width=3)
    assert second.blame is Blame.WORK
    assert {s.worker for s in second.seen} == {"w0", "w1"}


def test_a_failure_that_stays_with_a_worker_over_other_work_is_the_workers():
    a = Attribution()
    msg = "FileNotFoundError: [Errno 2] No such file or directory: '/mnt/data/shard-{}'"
    first = a.judge(Sighting("w2", Work(step=4, micro_batch=5, sample=9), sig(msg.format(9)),
                             node="B"), width=3)
    assert first.blame is Blame.RETRY
    # The sample loaded fine elsewhere; w2 now fails on another one the same way.
    second = a.judge(Sighting("w2", Work(step=4, micro_batch=4, sample=31), sig(msg.format(31)),
                              node="B"), width=3)
    assert second.blame is Blame.WORKER


def test_another_worker_of_the_same_node_failing_the_same_way_blames_the_node():
    a = Attribution()
    msg = "FileNotFoundError: [Errno 2] No such file or directory: '/mnt/data/shard-{}'"
    a.judge(Sighting("w2", Work(step=4, micro_batch=5, sample=9), sig(msg.format(9)), node="B"),
            width=4)
    second = a.judge(Sighting("w3", Work(step=4, micro_batch=7, sample=12), sig(msg.format(12)),
                              node="B"), width=4)
    assert second.blame is Blame.WORKER and second.node == "B"


def test_a_second_bad_sample_failing_the_same_way_is_not_blamed_on_its_worker():
    a = Attribution()
    truncated = sig("OSError: image file is truncated")
    a.judge(Sighting("w0", Work(step=3, micro_batch=1, sample=17), truncated), width=3)
    assert a.judge(Sighting("w1", Work(step=3, micro_batch=0, sample=17), truncated),
                   width=3).blame is Blame.WORK
    # w1 next fails on another bad sample: likely more bad data, so it runs elsewhere first.
    third = a.judge(Sighting("w1", Work(step=3, micro_batch=2, sample=40), truncated), width=3)
    assert third.blame is Blame.RETRY


def test_at_width_one_a_repeat_replaces_the_worker_and_the_replacement_decides():
    a = Attribution()
    w = Work(step=2, micro_batch=0, sample=5)
    s = sig("OSError: boom")
    assert a.judge(Sighting("w0", w, s), width=1).blame is Blame.RETRY  # again, in place
    assert a.judge(Sighting("w0", w, s), width=1).blame is Blame.WORKER  # a replacement next
    assert a.judge(Sighting("w1", w, s), width=1).blame is Blame.WORK  # ... failed as w0 did


def test_a_second_hang_on_the_same_work_is_the_works_and_the_first_doubles_its_deadline():
    a = Attribution()
    w = Work(step=6, micro_batch=2)
    assert a.patience(w) == 1.0
    first = a.judge(Sighting("w0", w, "hung:compute", how="hung"), width=3)
    assert first.blame is Blame.WORKER
    assert a.patience(w) == 2.0
    second = a.judge(Sighting("w1", w, "hung:compute", how="hung"), width=2)
    assert second.blame is Blame.WORK
    # A hang elsewhere is a first hang again.
    assert a.judge(Sighting("w2", Work(step=7, micro_batch=2), "hung:compute", how="hung"),
                   width=2).blame is Blame.WORKER


def test_different_errors_on_the_same_sample_are_not_one_fault():
    a = Attribution()
    w = Work(step=3, micro_batch=1, sample=17)
    a.judge(Sighting("w0", w, sig("OSError: timed out")), width=3)
    assert a.judge(Sighting("w1", w, sig("MemoryError: ")), width=3).blame is Blame.RETRY


def test_signatures_mask_numbers():
    assert sig("OSError: [Errno 5] shard-00017 at 0xdeadbeef") == sig(
        "OSError: [Errno 5] shard-00042 at 0x1234")
    assert sig("OSError: a") != sig("ValueError: a")
