"""The commit log (planaria.control.commit_log), without Ray: the committed step count, the
records a commit writes (events, losses, ledger), skips, non-finite steps, and the steps
adopted from a save beside them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from planaria.control.commit_log import CommitLog
from planaria.control.policy import HangConfig
from planaria.control.watchdog import StepDeadline
from planaria.data.plan import DataPlan, Ledger
from planaria.faults.errors import NonFiniteLoss
from planaria.observe.events import EventLog
from planaria.wire.reports import Attempt, Joined, Served, StepTotals


class Recorder:
    """The event log's listener: every record emitted, and the commits reported."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.commits: list[tuple[int, float]] = []

    def __call__(self, record: dict[str, Any]) -> None:
        self.events.append(record)

    def of(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    def on_commit(self, step: int, t: float) -> None:
        self.commits.append((step, t))


def commit_log(tmp_path, *, ledger: bool = True) -> tuple[CommitLog, Recorder]:
    log = EventLog(tmp_path)
    seen = Recorder()
    log.add_listener(seen)
    out = CommitLog(log=log, deadline=StepDeadline(HangConfig()), micro_batch_size=4,
                    ledger_dir=tmp_path if ledger else None, run_id="r1")
    out.on_commit = seen.on_commit
    return out, seen


def rec(step: int, *, loss_sum: float = 8.0, samples: int = 16, **extra: Any) -> StepTotals:
    fields: dict[str, Any] = {
        "step": step, "t0": 10.0 + step, "t": 10.5 + step, "global_samples": samples,
        "global_loss_sum": loss_sum, "data_wait_s": 0.01, "grad_norm": 1.0, "overflow": False,
        "finite": True, "global_metric_sums": {}}
    return StepTotals(**{**fields, **extra})


def served(step: int, workers: tuple[str, ...] = ("w0", "w1")) -> dict[str, Served]:
    return {w: Served(ids=[step * 10 + i for i in range(2)], digests=None) for w in workers}


def test_a_recorded_step_is_committed_with_its_totals(tmp_path):
    log, seen = commit_log(tmp_path)
    assert log.steps_done == 0
    result = log.record_step(rec(0, global_metric_sums={"acc": 12.0}), gen=2, width=3)
    assert log.steps_done == 1
    assert (result.step, result.loss, result.width) == (0, 0.5, 3)
    assert result.metrics == {"acc": 0.75}
    assert result.samples_per_s == pytest.approx(32.0)
    assert list(log.losses) == [(0, 0.5)]
    [committed] = seen.of("step_committed")
    assert (committed["step"], committed["gen"], committed["width"]) == (0, 2, 3)
    assert seen.commits == [(0, 10.5)]  # the recovery hears of each commit, at its time


def test_an_fp16_overflow_is_recorded_and_still_commits(tmp_path):
    log, seen = commit_log(tmp_path)
    log.record_step(rec(0, overflow=True), gen=0, width=1)
    assert log.steps_done == 1 and len(seen.of("step_overflow")) == 1


def test_the_ledger_has_what_each_rank_was_served_then_the_commit(tmp_path):
    log, _ = commit_log(tmp_path)
    log.ledger_step(0, served(0), gen=0)
    log.ledger_step(1, served(1), gen=0)
    log.ledger.close()
    assert Ledger.committed(tmp_path) == {0: [0, 1, 0, 1], 1: [10, 11, 10, 11]}


def test_without_a_ledger_nothing_is_written(tmp_path):
    log, _ = commit_log(tmp_path, ledger=False)
    log.ledger_step(0, served(0), gen=0)
    log.ledger_served(1, served(1), gen=0)
    log.ledger_dropped({"w0": Joined(steps_done=1, dropped=Attempt(
        gen=0, step=1, served=Served(ids=[1], digests=None)))})
    assert log.ledger is None and not (tmp_path / Ledger.FILE).exists()


def test_a_non_finite_step_raises_and_its_attempt_is_in_the_ledger_uncommitted(tmp_path):
    log, _ = commit_log(tmp_path)
    with pytest.raises(NonFiniteLoss, match="loss is nan at step 3") as err:
        log.record_nonfinite(rec(3, loss_sum=float("nan")), served(3), gen=1)
    assert err.value.step == 3 and log.steps_done == 0
    with pytest.raises(NonFiniteLoss, match="gradient norm is inf at step 4"):
        log.record_nonfinite(rec(4, grad_norm=float("inf")), {}, gen=1)
    log.ledger.close()
    assert Ledger.committed(tmp_path) == {}
    assert {r["step"] for r in Ledger.read(tmp_path) if r["kind"] == "served"} == {3}


def test_a_skipped_step_counts_as_done_and_the_ledger_says_it_was_skipped(tmp_path):
    log, seen = commit_log(tmp_path)
    log.ledger_served(0, served(0), gen=0)
    log.skip_pending(0, gen=0)
    assert (log.steps_done, log.last_skipped) == (1, 0)
    assert seen.of("step_skipped")[0]["reason"] == "nonfinite_loss"
    log.ledger.close()
    assert Ledger.committed(tmp_path) == {} and set(Ledger.skipped(tmp_path)) == {0}


def test_skipped_samples_are_recorded_once(tmp_path):
    log, seen = commit_log(tmp_path)
    log.skip_samples([5, 3], step=2, reason="a work fault")
    log.skip_samples([3, 7], step=4, reason="a work fault")
    assert log.skipped_samples == {3, 5, 7}
    assert [e["samples"] for e in seen.of("sample_skipped")] == [[3, 5], [7]]
    log.ledger.close()
    assert Ledger.skipped_samples(tmp_path) == {3: 2, 5: 2, 7: 4}


def test_a_failed_runs_survivors_advance_the_count_but_never_back(tmp_path):
    log, _ = commit_log(tmp_path)
    log.record_step(rec(0), gen=0, width=2)
    log.advance_to(4)
    assert log.steps_done == 4
    log.advance_to(2)
    assert log.steps_done == 4
    log.restart_at(2)  # a restore: the count goes where the state is
    assert log.steps_done == 2


def test_steps_a_save_holds_are_committed_once_in_the_ledger(tmp_path):
    log, _ = commit_log(tmp_path)
    log.record_step(rec(0), gen=1, width=2)
    log.ledger_step(0, served(0), gen=1)
    log.ledger_served(1, served(1), gen=1)  # step 1's attempt is in the ledger already
    assert log.commit_saved(3, {2: served(2)}, gen=1) == [1, 2]
    assert log.steps_done == 3
    assert log.commit_saved(3, {}, gen=1) == []  # nothing more to adopt
    log.ledger.close()
    committed = Ledger.committed(tmp_path)
    assert sorted(committed) == [0, 1, 2]
    assert committed[1] == [10, 11, 10, 11]  # served once, not twice


def test_survivors_report_of_a_dropped_attempt_is_recorded_unless_recorded_already(tmp_path):
    log, _ = commit_log(tmp_path)
    log.ledger_served(5, served(5, ("w0",)), gen=2)
    dropped = {"w0": Joined(steps_done=5, dropped=Attempt(
                   gen=2, step=5, served=Served(ids=[50, 51], digests=None))),
               "w1": Joined(steps_done=5, dropped=Attempt(
                   gen=1, step=4, served=Served(ids=[40, 41], digests=None)))}
    log.ledger_dropped(dropped)
    log.ledger.close()
    served_records = [(r["gen"], r["step"], r["worker"]) for r in Ledger.read(tmp_path)
                      if r["kind"] == "served"]
    assert served_records == [(2, 5, "w0"), (1, 4, "w1")]


def test_a_steps_samples_are_split_in_whole_micro_batches_once_the_plan_is_known(tmp_path):
    log, _ = commit_log(tmp_path)
    assert [len(p) for p in log.split(0, 3)] == [0, 0, 0]
    log.plan = DataPlan(64, 16, seed=0)
    parts = log.split(2, 3)
    assert [len(p) for p in parts] == [8, 4, 4]
    assert sorted(np.concatenate(parts).tolist()) == sorted(log.plan.batch(2).tolist())


def test_samples_served_again_with_other_content_are_reported(tmp_path):
    log, seen = commit_log(tmp_path)
    log.ledger_served(0, {"w0": Served(ids=[1, 2], digests=[11, 12])}, gen=0)
    log.ledger_served(0, {"w1": Served(ids=[1, 2], digests=[11, 99])}, gen=1)
    [changed] = seen.of("dataset_nondeterministic")
    assert (changed["step"], changed["samples"], changed["worker"]) == (0, [2], "w1")
