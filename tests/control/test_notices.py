"""Preemption notices (planaria.control.notices), without Ray: read from the store into the
departures, and the wave of notices that makes every holder of the state leave together
after a save beside the steps."""

from __future__ import annotations

from typing import Any

from control_fakes import FakeRoster, handle
from planaria.checkpoint.config import CheckpointConfig
from planaria.control.departures import Departures, FaultTimes
from planaria.control.notices import Notices
from planaria.observe.events import EventLog
from planaria.wire import store_keys


class FakeStore:
    """The store's side of notices: a counter and one key per worker that got one."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.count = 0

    def notify(self, worker: str, at: float) -> None:
        self.keys[store_keys.notice(worker)] = str(at).encode()
        self.count += 1

    def add(self, key: str, amount: int) -> int:
        assert key == store_keys.NOTICES
        self.count += amount
        return self.count

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        return self.keys[key]


class Saver:
    """The checkpoints' side of a wave: a save beside the steps, started or not."""

    def __init__(self, *, can_save: bool = True) -> None:
        self.config = CheckpointConfig(root="/nowhere", every=10)
        self.can_save = can_save
        self.saves: list[str] = []

    def save_beside(self, *, reason: str) -> bool:
        self.saves.append(reason)
        return True


class Steps:
    steps_done = 7


def notices(tmp_path, names: tuple[str, ...], *, checkpoints: Any = None,
            nodes: dict[str, int] | None = None) -> tuple[Notices, FakeStore, Departures,
                                                          list[dict[str, Any]], list[str]]:
    log = EventLog(tmp_path)
    seen: list[dict[str, Any]] = []
    log.add_listener(seen.append)
    store, departures, aborted = FakeStore(), Departures(), []
    members = [handle(n, node=f"node-{n}") for n in names]
    dropped: list[set[str]] = []

    class Pool:
        def drop_spares_on(self, nodes: set[str]) -> list[str]:
            dropped.append(nodes)
            return []

    out = Notices(store=store, roster=FakeRoster(members), departures=departures,
                  fault_times=FaultTimes(lambda name: None), log=log, steps=Steps(),
                  checkpoints=checkpoints, pool=Pool(),  # type: ignore[arg-type]
                  draining_nodes=None if nodes is None else (lambda: nodes),
                  abort_generation=lambda: aborted.append("abort"))
    return out, store, departures, seen, aborted


def test_a_notice_marks_its_worker_to_drain_and_dates_its_fault(tmp_path):
    n, store, departures, seen, aborted = notices(tmp_path, ("w0", "w1", "w2"))
    n.poll()  # nothing came: nothing read but the counter
    assert not departures.draining
    store.notify("w1", 123.5)
    n.poll()
    assert departures.draining == {"w1"} and not departures.evacuating and not aborted
    assert n.fault_times.fault_time(("w1",)) == 123.5  # the fault dates from the notice
    [notice] = [e for e in seen if e["event"] == "preempt_notice"]
    assert (notice["worker"], notice["step"], notice["source"]) == ("w1", 7, "sigterm")
    assert n.take_draining() == ["w1"] and not departures.draining


def test_every_holder_notified_saves_beside_the_steps_and_they_leave_together(tmp_path):
    saver = Saver()
    n, store, departures, _, aborted = notices(tmp_path, ("w0", "w1"), checkpoints=saver)
    store.notify("w0", 1.0)
    store.notify("w1", 2.0)
    n.poll()
    assert saver.saves == ["preemption"]
    assert departures.evacuating == ("w0", "w1") and departures.leave_now
    assert aborted == ["abort"]  # the calls in flight end: they leave at the step in hand


def test_without_checkpoints_a_wave_is_recorded_and_the_last_one_stays(tmp_path):
    n, store, departures, seen, aborted = notices(tmp_path, ("w0", "w1"))
    store.notify("w0", 1.0)
    store.notify("w1", 2.0)
    n.poll()
    assert not departures.evacuating and not aborted
    assert [e["workers"] for e in seen if e["event"] == "preemption_unsaved"] == [["w0", "w1"]]


def test_members_on_a_drained_node_get_their_notice_and_its_spares_go(tmp_path):
    n, _, departures, seen, _ = notices(tmp_path, ("w0", "w1"), nodes={"node-w1": 5000})
    n.notice_draining_nodes()
    assert departures.draining == {"w1"}
    [notice] = [e for e in seen if e["event"] == "preempt_notice"]
    assert (notice["source"], notice["deadline_t"]) == ("node_drain", 5.0)


def test_a_runs_report_of_a_notice_and_a_kept_drainer(tmp_path):
    n, _, departures, seen, _ = notices(tmp_path, ("w0", "w1"))
    n.reported("w0", False, 3)
    n.reported("w1", True, 3)
    n.reported("w1", True, 4)  # known already: one event
    n.keep_draining("w0")
    assert departures.draining == {"w0", "w1"}
    assert len([e for e in seen if e["event"] == "preempt_notice"]) == 1
