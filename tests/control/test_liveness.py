"""Busy is not hung: liveness and progress judged on the controller's (injected) clock."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from planaria.control.liveness import Liveness
from planaria.wire import store_keys
from planaria.wire.heartbeat import Heartbeat


class Clock:
    """A clock the test moves (``t``); its wall clock reads 1000 s ahead."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t

    def now(self) -> float:
        return 1000.0 + self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def beat(store: dist.Store, name: str, n: int, phase: str, progress: int) -> None:
    store.set(store_keys.heartbeat(name), Heartbeat(n, phase, 3, 0, False, progress).format())


def make() -> tuple[dist.Store, Liveness, Clock]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    clock = Clock()
    return store, Liveness(store, timeout_s=3.0, clock=clock), clock


def test_a_busy_worker_that_beats_and_progresses_is_never_hung():
    store, live, clock = make()
    for i in range(100):  # 100 s of a long compute: beats change, progress moves
        beat(store, "w0", i, "compute", i // 10)
        assert live.hung(["w0"], deadline_s=20.0) == []
        clock.t += 1.0


def test_a_stopped_heartbeat_is_hung_on_the_controllers_clock():
    store, live, clock = make()
    beat(store, "w1", 1, "compute", 5)
    assert live.hung(["w1"], deadline_s=600.0) == []
    clock.t += 2.9
    assert live.hung(["w1"], deadline_s=600.0) == []
    clock.t += 0.2  # 3.1 s without a change: SIGSTOP'ed or frozen
    assert live.hung(["w1"], deadline_s=600.0) == ["w1"]


def test_no_progress_in_its_own_work_past_the_deadline_is_stuck_but_waiting_is_not():
    store, live, clock = make()
    for i in range(12):
        beat(store, "w0", i, "compute", 7)  # heartbeat alive, progress frozen
        beat(store, "w1", i, "reduce", 7)  # waiting on a peer: never judged by progress
        clock.t += 1.0
        hung = live.hung(["w0", "w1"], deadline_s=10.0)
    assert hung == ["w0"]


def test_a_call_restarts_the_progress_clock():
    store, live, clock = make()
    beat(store, "w2", 1, "apply", 4)  # left labelled "apply" by its last call
    live.observe(["w2"])
    clock.t += 60.0  # the controller was busy elsewhere for a minute
    beat(store, "w2", 2, "apply", 4)
    live.watch(["w2"])  # a new call is sent now
    clock.t += 1.0
    beat(store, "w2", 3, "apply", 4)
    assert live.hung(["w2"], deadline_s=10.0) == []


def test_a_read_that_moves_bytes_is_moving_and_one_that_stopped_is_not():
    store, live, clock = make()
    for i in range(40):  # a slow restore: a chunk every second
        beat(store, "w0", i, "ckpt_read", i)
        beat(store, "w1", i, "ckpt_read", 3)  # bytes stopped moving after the start
        live.observe(["w0", "w1"])
        clock.t += 1.0
    assert live.moving("w0", within_s=5.0)
    assert not live.moving("w1", within_s=5.0)
    beat(store, "w2", 1, "compute", 1)  # not an I/O phase: never "moving"
    live.observe(["w2"])
    assert not live.moving("w2", within_s=5.0)


def test_a_vouch_stands_for_a_while_and_dates_what_changed_unseen():
    """While a run's steps commit, the controller reads no heartbeat (a vouch); a worker
    that stopped right after the last vouch is still found hung about timeout_s after it."""
    store, live, clock = make()
    ranks = frozenset({"w0", "w1"})
    assert live.vouch_s == 1.0 and not live.vouched_recently()
    beat(store, "w0", 1, "compute", 1)
    beat(store, "w1", 1, "compute", 1)
    live.observe(["w0", "w1"])  # t = 1000
    clock.t += 4.0
    beat(store, "w0", 2, "compute", 9)  # both beat while nobody read them...
    beat(store, "w1", 2, "compute", 9)
    live.vouch(ranks)  # ...and committed a step together at t = 1004; then w1 stops
    clock.t += 1.0
    assert live.vouched_recently()
    clock.t += 0.1
    assert not live.vouched_recently()  # the steps stopped coming: read them again
    beat(store, "w0", 3, "compute", 10)  # w0 still beats
    assert live.hung(["w0", "w1"], deadline_s=600.0) == []  # t = 1005.1
    clock.t += 1.0
    beat(store, "w0", 4, "compute", 11)
    assert live.hung(["w0", "w1"], deadline_s=600.0) == []  # t = 1006.1
    clock.t += 1.1  # t = 1007.2: 3.1 s after its change is dated (1004.1, vouch_s before
    beat(store, "w0", 5, "compute", 12)  # the first read; the vouch, w1's last sign, 1004)
    assert live.hung(["w0", "w1"], deadline_s=600.0) == ["w1"]


def test_a_vouch_covers_only_the_runs_ranks():
    store, live, clock = make()
    beat(store, "spare", 1, "idle", 1)
    live.observe(["spare"])
    clock.t += 2.0
    beat(store, "spare", 2, "idle", 1)
    live.vouch(frozenset({"w0"}))  # the spare is in no run: its change is dated when read
    clock.t += 1.5
    assert live.hung(["spare"], deadline_s=600.0) == []
    clock.t += 2.9
    assert live.hung(["spare"], deadline_s=600.0) == []  # 2.9 s since it was read changed


def test_a_read_long_after_a_vouch_finds_no_live_worker_silent():
    """The next generation's first read comes seconds after the last run's last vouch (a
    replacement started meanwhile): a record that changed is not dated back to it."""
    store, live, clock = make()
    beat(store, "w0", 1, "idle", 1)
    live.observe(["w0"])
    clock.t += 10.0
    live.vouch(frozenset({"w0"}))  # the last run's last step
    clock.t += 5.0  # waiting for a replacement; nobody reads
    beat(store, "w0", 2, "rendezvous", 2)
    assert live.hung(["w0"], deadline_s=600.0) == []
    clock.t += 1.5
    beat(store, "w0", 3, "rendezvous", 2)
    assert live.hung(["w0"], deadline_s=600.0) == []


def test_a_vouch_is_a_sighting_of_a_worker_that_skipped_its_beats():
    """Progress is the heartbeat: while its run commits, a worker writes no beat. The
    controller counts each vouch as a sighting, so an unchanged record is silent only since
    the last vouch (and stuck only that long), and a worker that stopped after it is still
    found hung timeout_s later."""
    store, live, clock = make()
    beat(store, "w0", 1, "compute", 1)
    beat(store, "w1", 1, "compute", 1)
    live.observe(["w0", "w1"])  # t = 1000; then both go quiet (their run commits)
    for _ in range(5):
        clock.t += 1.0
        live.vouch(frozenset({"w0", "w1"}))  # t = 1005: the last step seen on the stream
    clock.t += 1.5
    assert live.hung(["w0", "w1"], deadline_s=2.0) == []  # silent 1.5 s, not 6.5 s
    beat(store, "w0", 2, "compute", 2)  # the steps stopped: w0 beats again, w1 stopped
    clock.t += 1.6  # t = 1008.1: w1 silent 3.1 s since the vouch
    assert live.hung(["w0", "w1"], deadline_s=600.0) == ["w1"]


def test_a_quiet_worker_skips_its_heartbeat_writes():
    import threading

    from planaria.wire.heartbeat import beat as beat_thread

    store, _, _ = make()
    port = store.port
    quiet = threading.Event()
    quiet.set()
    stop = threading.Event()
    written: list[int] = []

    def record(gap_s: float = 0.0) -> str:
        written.append(1)
        return Heartbeat(len(written), "compute", 0, 0, False, 0).format()

    def connect() -> dist.Store:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))

    t = threading.Thread(target=beat_thread, args=(connect, "w0", record, stop, 0.02,
                                                   quiet.is_set))
    t.start()
    try:
        stop.wait(0.3)
        # quiet: nothing written
        assert written == [] and not store.check([store_keys.heartbeat("w0")])
        quiet.clear()
        deadline = 1000  # 20 s: a loaded machine may be slow to schedule the thread
        while not written and deadline:
            stop.wait(0.02)
            deadline -= 1
        assert written and store.check([store_keys.heartbeat("w0")])
    finally:
        stop.set()
        t.join()


def test_a_fault_is_dated_no_earlier_than_the_last_vouch():
    """A worker that dies in a run (its beats skipped) was alive at the last vouch."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    clock = Clock()
    live = Liveness(store, timeout_s=3.0, clock=clock)
    beat(store, "w0", 1, "compute", 1)
    live.observe(["w0"])
    clock.t += 8.0
    live.vouch(frozenset({"w0"}))
    clock.t += 0.5
    assert live.last_alive_t("w0") == 1000.0 + clock.t - 0.5


def record(store: dist.Store, name: str, n: int, phase: str, progress: int, *, work: str = "",
           busy: int = 0, gap_ms: int = 0) -> None:
    store.set(store_keys.heartbeat(name),
              Heartbeat(n, phase, 3, 0, False, progress, work, busy, gap_ms).format())


def test_a_busy_thread_is_progress_though_no_micro_batch_ends():
    store, live, clock = make()
    for i in range(40):  # a 40 s micro-batch whose thread computes: busy beats move
        record(store, "w0", i, "compute", 7, work="m3", busy=i)
        clock.t += 1.0
        assert live.hung(["w0"], deadline_s=5.0) == []
    for i in range(40, 47):  # the same thread blocked: no busy beat
        record(store, "w0", i, "compute", 7, work="m3", busy=39)
        clock.t += 1.0
    assert live.hung(["w0"], deadline_s=5.0) == ["w0"]


def test_a_deadline_can_depend_on_the_work_the_record_names():
    store, live, clock = make()
    record(store, "w0", 0, "loading", 7, work="i42")
    live.observe(["w0"])
    for i in range(1, 30):
        record(store, "w0", i, "loading", 7, work="i42")
        clock.t += 1.0
    # 29 s on one sample: past a 5 s step deadline, within a 120 s I/O deadline.
    assert live.hung(["w0"], deadline_s=5.0) == ["w0"]
    assert live.hung(["w0"], deadline_s=lambda hb: 120.0 if hb.phase == "loading" else 5.0) == []


def test_the_heartbeat_timeout_grows_with_the_longest_pause_a_live_worker_reports():
    store, live, clock = make()
    record(store, "w0", 0, "compute", 1)
    live.observe(["w0"])
    assert live.timeout_s == 3.0
    record(store, "w0", 1, "compute", 2, gap_ms=2500)  # it paused 2.5 s and came back
    live.observe(["w0"])
    assert live.timeout_s == 7.5  # three times the pause
    clock.t += 7.0
    assert live.hung(["w0"], deadline_s=600.0) == []  # a like pause is no hang now
    clock.t += 1.0
    assert live.hung(["w0"], deadline_s=600.0) == ["w0"]


def test_every_rank_waiting_on_peers_with_no_progress_is_noticed():
    store, live, clock = make()
    for i in range(8):
        record(store, "w0", i, "reduce", 4)
        record(store, "w1", i, "reduce", 9)
        live.observe(["w0", "w1"])
        clock.t += 1.0
    assert live.all_waiting(["w0", "w1"], for_s=5.0)
    assert not live.all_waiting(["w0", "w1"], for_s=10.0)
    record(store, "w1", 9, "compute", 10)
    live.observe(["w1"])
    assert not live.all_waiting(["w0", "w1"], for_s=5.0)


def test_the_time_a_whole_process_was_paused_is_not_its_works():
    store, live, clock = make()
    live = Liveness(store, timeout_s=10.0, clock=clock)
    for i in range(3):
        record(store, "w0", i, "compute", 7, work="m1")
        live.observe(["w0"])
        clock.t += 1.0  # 2 s into its micro-batch
    clock.t += 8.0  # paused as a whole (SIGSTOP, a VM freeze): its heartbeat is silent too
    assert live.hung(["w0"], deadline_s=5.0) == []  # judged by the heartbeat timeout (10 s)
    record(store, "w0", 3, "compute", 7, work="m1")  # back, the same micro-batch going on
    assert live.hung(["w0"], deadline_s=5.0) == []  # 2 s of its own work, not 11
    for i in range(4, 6):
        clock.t += 1.0
        record(store, "w0", i, "compute", 7, work="m1")
        assert live.hung(["w0"], deadline_s=5.0) == []
    clock.t += 2.5
    record(store, "w0", 7, "compute", 7, work="m1")
    assert live.hung(["w0"], deadline_s=5.0) == ["w0"]  # past 5 s of its own: stuck
