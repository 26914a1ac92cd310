"""The worker's store flags read off its training thread (KeyWatch), and its seeding."""

from __future__ import annotations

import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from planaria.data.randomness import seed_torch
from planaria.worker.key_watch import KeyWatch


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=5))


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))


def _seen_within(watch: KeyWatch, key: str, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if watch.seen(key):
            return True
        time.sleep(0.005)
    return watch.seen(key)


class _CountedLooks:
    """A store client that counts the watch's looks (its ``check`` calls)."""

    def __init__(self, port: int) -> None:
        self.store = _client(port)
        self.looks = 0

    def check(self, keys: list[str]) -> bool:
        self.looks += 1
        return bool(self.store.check(keys))


def test_a_key_set_while_busy_is_seen_at_the_next_look():
    server = _store()
    client = _CountedLooks(server.port)
    watch = KeyWatch(lambda: client)
    try:
        watch.watch("abort/3", 0.02)
        with watch.busy():
            assert not _seen_within(watch, "abort/3", 0.1)
            before = client.looks
            server.set("abort/3", "1")
            assert _seen_within(watch, "abort/3", 30.0)
            # A look under way as it was set may miss it; the next one sees it.
            assert client.looks - before <= 2
        assert not watch.seen("abort/4")  # another generation's key is its own
    finally:
        watch.close()


def test_keys_are_not_read_between_steps_and_forget_drops_them():
    server = _store()
    client = _CountedLooks(server.port)
    watch = KeyWatch(lambda: client)
    try:
        watch.watch("stop/0/1", 0.01)
        server.set("stop/0/1", "join")
        assert not _seen_within(watch, "stop/0/1", 0.15)
        assert client.looks == 0  # not busy: no store traffic
        with watch.busy():
            assert _seen_within(watch, "stop/0/1", 1.0)
        watch.forget("stop/")
        assert not watch.seen("stop/0/1")
        with watch.busy():
            assert not _seen_within(watch, "stop/0/1", 0.1)  # forgotten: not looked for
    finally:
        watch.close()


def test_seed_torch_draws_torch_manual_seeds_cpu_stream_without_formatting_stacks(
    monkeypatch,
):
    torch.manual_seed(1234)
    expected = torch.rand(8)
    formatted = []
    real = traceback.format_stack
    monkeypatch.setattr(traceback, "format_stack", lambda *a: formatted.append(1) or real(*a))
    seed_torch(1234)
    assert torch.equal(torch.rand(8), expected)
    # torch.manual_seed formats the caller's stack for a deferred CUDA seeding where CUDA is
    # not initialized, every call (~0.5 ms a micro-batch in a worker): seed_torch must not
    assert formatted == [] or torch.cuda.is_initialized()


def test_serve_samples_gives_each_sample_its_own_seed_and_names_the_one_that_failed():
    import pytest

    from planaria.data.randomness import sample_scope, sample_seed, serve_samples

    seeds = serve_samples(7, 3, lambda i: sample_seed(), [5, 9, 5])
    with sample_scope(7, 3, 5):
        five = sample_seed()
    with sample_scope(7, 3, 9):
        nine = sample_seed()
    assert seeds == [five, nine, five] and five != nine

    def getitem(i: int) -> int:
        if i == 9:
            raise KeyError(i)
        return i

    with sample_scope(1, 1, 1):  # an enclosing scope comes back afterwards
        before = sample_seed()
        with pytest.raises(KeyError) as info:
            serve_samples(7, 3, getitem, [5, 9])
        assert sample_seed() == before
    assert "loading sample 9 of step 3" in "".join(traceback.format_exception(info.value))
