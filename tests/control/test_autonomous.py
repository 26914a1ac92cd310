"""The autonomous loop (planaria.control.run_ahead, planaria.worker.run_loop): workers run steps
on their own between boundaries; a run that fails is reconciled so that no step a survivor
completed is lost and every live replica ends with the same state.

Faults land at named points of a worker's loop (planaria.faults.points: called
once a step's gradient is computed, before its all-reduce, and once it is reduced, before
it is applied), installed in the live actor: a kill, a hang and a preemption after the
reduction, a survivor whose collective failed while a peer's completed, a non-finite
gradient and a user error on one rank. Faults inside a step's computation (chaos at a
step, which a run starts at) are the other recovery tests' (they run under ``fit``, the
autonomous loop).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import ray

import planaria
from planaria import Job, RunConfig, fit
from planaria.checkpoint.config import CheckpointConfig
from planaria.data.plan import DataPlan
from planaria.examples import bn_mlp
from planaria.faults.errors import StepAborted, UserCodeError
from planaria.fit import _finish as finish
from tests.assertions import assert_exactly_once, assert_same_state, events, of
from tests.assertions import drive as drive_steps
from tests.loop_faults import DieLeavingSocketsOpen, SignalSelfAt, install

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

N, G, STEPS = 512, 64, 16
FAULT_STEP = 6


def spec() -> planaria.TrainSpec:
    return bn_mlp.make_spec(n=N)  # BatchNorm buffers and dropout: replicas must not drift


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ray_cluster):
    """The same spec one step at a time (``Job.train_step``: runs of one step), one replica."""
    with Job(spec(), RunConfig(steps=STEPS, replicas=1,
                               run_dir=tmp_path_factory.mktemp("ref"))) as job:
        while job.steps_done < STEPS:
            job.train_step()
        return finish(job)


def test_runs_of_many_steps_equal_steps_one_at_a_time(tmp_path, reference):
    result = fit(spec(), steps=STEPS, replicas=3, run_dir=tmp_path, ledger=True,
                 verify_every=5)
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(tmp_path)
    # Step 0 runs alone (it names the loss's metrics); then runs end at each replica check
    # (every 5 steps); the last step runs alone before the end.
    assert [(r["start"], r["steps"], r["ended"]) for r in of(evs, "run_ahead")] == [
        (0, 1, "until"), (1, 4, "until"), (5, 5, "until"), (10, 5, "until"),
        (15, 1, "until"),
    ]
    assert [e["step"] for e in of(evs, "replicas_verified")] == [5, 10, 15]
    assert [e["step"] for e in of(evs, "step_committed")] == list(range(STEPS))


def _pid(job: Job, name: str) -> int:
    pid = next(h for h in job.members if h.name == name).pid
    assert pid is not None
    return pid


def _drive(job: Job, steps: int) -> dict:
    """fit()'s loop, waiting (bounded) for the full width before the last 3 steps."""
    while job.steps_done < steps:
        try:
            if job.steps_done == steps - 3:
                job.wait_for_width(job.config.replicas, timeout_s=180)
            job.run_steps(steps - 3 if job.steps_done < steps - 3 else steps)
        except planaria.Failure as failure:
            job.recovery.handle(failure)
    return finish(job)


class _KillPeerAndFailHere:
    """At ``step``, once the reduction completed here: SIGKILL ``peer_pid`` and abandon the
    step here as if this rank's collective had failed (the case of a rank dying mid-ring,
    where the reduction completes on some survivors and not on others)."""

    def __init__(self, step: int, peer_pid: int, marker: str) -> None:
        self.step, self.peer_pid, self.marker = step, peer_pid, marker

    def __call__(self, worker: Any, step: int, phase: str) -> None:
        if phase == "reduced" and step == self.step and not os.path.exists(self.marker):
            Path(self.marker).write_text(worker.name)
            os.kill(self.peer_pid, signal.SIGKILL)
            end = time.monotonic() + 30  # until it is gone (its sockets closed: the peers
            while time.monotonic() < end:  # see it gone); then this rank's reduction "failed"
                try:
                    with open(f"/proc/{self.peer_pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                            break
                except FileNotFoundError:
                    break
                time.sleep(0.01)
            raise StepAborted(f"{worker.name}: the collective of step {step} failed here")


def _signal_w1_at(tmp_path: Path, reference: dict, phase: str, signum: int) -> list:
    """A run of STEPS steps at 3 replicas where w1 gets ``signum`` in ``phase`` of step
    FAULT_STEP; checks the fault-free weights, every sample once, every step committed once.
    Returns the run's events."""
    marker = str(tmp_path / "fired")
    run_dir = tmp_path / "run"
    config = RunConfig(steps=STEPS, replicas=3, run_dir=run_dir, ledger=True)
    with Job(spec(), config) as job:
        job.run_steps(1)  # the first step, alone: the metrics are named
        install(job, "w1", SignalSelfAt(FAULT_STEP, phase, signum, marker))
        state = _drive(job, STEPS)
    assert Path(marker).read_text() == "w1"
    assert_same_state(reference, state)
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run_dir)
    assert [e["step"] for e in of(evs, "step_committed")] == list(range(STEPS))
    return evs


@pytest.mark.parametrize("signum", [
    signal.SIGKILL, signal.SIGSTOP,
    pytest.param(signal.SIGTERM, marks=pytest.mark.extended),  # drains: test_recovery's too
], ids=["kill", "hang", "preempt"])
def test_a_fault_after_the_reduction_keeps_the_step(tmp_path, reference, signum):
    """w1 is killed, stopped or preempted once step s is reduced, before applying it: its
    peers completed the reduction too, so they apply step s, and it stays committed
    (never re-run, never lost)."""
    evs = _signal_w1_at(tmp_path, reference, "reduced", signum)
    if signum == signal.SIGTERM:  # planned: w1 applies step s, then leaves at a boundary
        assert [f["kind"] for f in of(evs, "fault")] == ["preempted"]
        assert not of(evs, "step_failed")
        assert [e["worker"] for e in of(evs, "drained")] == ["w1"]
        return
    fault = of(evs, "fault")[0]
    assert fault["worker"] == "w1"
    assert fault["kind"] == ("worker_lost" if signum == signal.SIGKILL else "worker_hung")
    assert fault["step"] == FAULT_STEP + 1  # the first step no survivor completed
    assert all(r["lost_steps"] == 0 for r in of(evs, "recovered"))


@pytest.mark.parametrize(("phase", "signum"), [
    ("loaded", signal.SIGKILL),
    pytest.param("computed", signal.SIGKILL, marks=pytest.mark.extended),
    pytest.param("computed", signal.SIGSTOP, marks=pytest.mark.extended),
    pytest.param("applied", signal.SIGKILL, marks=pytest.mark.extended),
    # a hang after the reduction: test_a_fault_after_the_reduction_keeps_the_step[hang]
    pytest.param("applied", signal.SIGSTOP, marks=pytest.mark.extended),
], ids=["kill-loaded", "kill-computed", "hang-computed", "kill-applied", "hang-applied"])
def test_a_fault_at_each_phase_of_the_loop(tmp_path, reference, phase, signum):
    """w1 is killed or stopped in a phase of its loop while the others run ahead: before
    the step's reduction (loaded, computed) no survivor completes step s, and it is run
    again at the new width; after it (applied) every survivor applied step s, and the
    failure falls on step s + 1. Either way: the fault-free weights, every sample once."""
    evs = _signal_w1_at(tmp_path, reference, phase, signum)
    fault = of(evs, "fault")[0]
    assert fault["worker"] == "w1"
    assert fault["kind"] == ("worker_lost" if signum == signal.SIGKILL else "worker_hung")
    assert fault["step"] == FAULT_STEP + (phase == "applied")
    assert all(r["lost_steps"] == 0 for r in of(evs, "recovered"))


LINGER_S = 60.0  # how long the dead worker's child holds its connections


def _die_leaving_sockets_open(tmp_path: Path, reference: Any, *,
                              lifeline_too: bool) -> tuple[dict[str, Any], list[dict]]:
    """w1 dies before the reduction of step FAULT_STEP while a child it forked holds its
    connections open (its lifeline too, with ``lifeline_too``): the final state is the
    fault-free one, every step committed once, every sample used once, and the step
    committed again before the child lets go (not when the connections close, nor at the
    collective timeout). Returns the fault and the event log."""
    marker = str(tmp_path / "fired")
    run_dir = tmp_path / "run"
    config = RunConfig(steps=STEPS, replicas=3, run_dir=run_dir, ledger=True)
    with Job(spec(), config) as job:
        job.run_steps(1)
        install(job, "w1", DieLeavingSocketsOpen(FAULT_STEP, marker, linger_s=LINGER_S,
                                                 lifeline_too=lifeline_too))
        state = _drive(job, STEPS)
    assert Path(marker).read_text() == "w1"
    died_t = os.path.getmtime(marker)  # written the moment before the fork and the kill
    assert_same_state(reference, state)
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run_dir)
    assert [e["step"] for e in of(evs, "step_committed")] == list(range(STEPS))
    (fault,) = of(evs, "fault")
    again = next(e for e in of(evs, "step_committed") if e["step"] == FAULT_STEP)
    assert fault["worker"] == "w1" and died_t < fault["t"] < again["t"] < died_t + LINGER_S
    return fault, evs


def test_a_death_whose_connections_stay_open_does_not_hold_the_survivors(tmp_path, reference):
    """w1 dies before the reduction, but a child of it holds its connections open, its
    lifeline too: the survivors' transport never sees it go, and would wait in the
    all-reduce for the collective timeout (300 s). The controller learns of the death
    from the silent heartbeat, and its abort interrupts their wait: seconds, the
    fault-free weights, every sample once."""
    fault, _ = _die_leaving_sockets_open(tmp_path, reference, lifeline_too=True)
    assert fault["kind"] == "worker_hung"


def test_a_death_whose_forked_child_holds_its_connections_is_known_from_its_lifeline(
        tmp_path, reference):
    """As above, but the child is a Python fork, which closes its copy of the lifeline:
    the controller knows of the death from it (a worker_lost, not a silent heartbeat's
    hang), long before the child lets go of the rest."""
    fault, evs = _die_leaving_sockets_open(tmp_path, reference, lifeline_too=False)
    assert fault["kind"] == "worker_lost"
    assert [(e["worker"], e["via"]) for e in of(evs, "failure_seen")] == [("w1", "lifeline")]


def test_a_survivor_behind_receives_the_state(tmp_path, reference):
    """w1's reduction of step s 'fails' while w0's completes and w2 dies: w0 is a step
    ahead. Step s stays committed; w1 drops its attempt and receives w0's state."""
    marker = str(tmp_path / "fired")
    run_dir = tmp_path / "run"
    config = RunConfig(steps=STEPS, replicas=3, run_dir=run_dir, ledger=True)
    with Job(spec(), config) as job:
        job.run_steps(1)
        install(job, "w1", _KillPeerAndFailHere(FAULT_STEP, _pid(job, "w2"), marker))
        state = _drive(job, STEPS)
        sums = job.checksums()
    assert len(set(sums.values())) == 1, sums  # every live replica holds the same state
    assert_same_state(reference, state)
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run_dir)
    failed = [r for r in of(evs, "run_ahead") if r["ended"] == "failed"]
    assert [(r["committed"], r["behind"]) for r in failed] == [(FAULT_STEP + 1, ["w1"])]
    assert any("w1" in e["dst"] for e in of(evs, "state_transfer"))
    assert [e["step"] for e in of(evs, "step_committed")] == list(range(STEPS))


class _OnOneRank:
    """At ``step``, with the gradient computed on this rank (before the reduction): make it
    non-finite (``"nan"``) or raise an error from the user's code (``"user_error"``)."""

    def __init__(self, step: int, what: str) -> None:
        self.step, self.what = step, what

    def __call__(self, worker: Any, step: int, phase: str) -> None:
        if phase != "computed" or step != self.step:
            return
        if self.what == "nan":
            worker.state.reducer.gradients()[0].fill_(float("nan"))
        else:
            raise UserCodeError(f"the loss function failed on {worker.name} at step {step}")


def _with_fault(run_dir: Path, fault: Any, *, one_at_a_time: bool = False
                ) -> tuple[dict, dict]:
    config = RunConfig(steps=STEPS, replicas=3, run_dir=run_dir, ledger=True)
    policy = planaria.RecoveryPolicy(on_nonfinite="skip")
    with Job(spec(), config, policy=policy) as job:
        job.run_steps(1)
        install(job, "w1", fault)
        if one_at_a_time:  # train_step: runs of one step
            drive_steps(job, STEPS)
            state = finish(job)
        else:
            state = _drive(job, STEPS)
        return state, job.checksums()


def test_a_nonfinite_gradient_on_one_rank_is_skipped_in_a_run_as_alone(tmp_path):
    """NaN in one rank's gradient: the reduced gradient is non-finite on every rank, they all
    end the run without applying it, the policy skips it; the same as in a run of one."""
    auto, sums = _with_fault(tmp_path / "auto", _OnOneRank(FAULT_STEP, "nan"))
    alone, _ = _with_fault(tmp_path / "alone", _OnOneRank(FAULT_STEP, "nan"),
                           one_at_a_time=True)
    assert len(set(sums.values())) == 1, sums
    assert_same_state(alone, auto)
    evs = events(tmp_path / "auto")
    assert [(r["start"] + r["steps"], r["ended"]) for r in of(evs, "run_ahead")
            if r["ended"] != "until"] == [(FAULT_STEP, "nonfinite")]
    assert [e["step"] for e in of(evs, "step_skipped")] == [FAULT_STEP]
    assert [e["step"] for e in of(events(tmp_path / "alone"), "step_skipped")] == [FAULT_STEP]


def test_a_user_error_on_one_rank_stops_the_job_without_a_hang(tmp_path):
    """An error in the user's code on one rank mid-run: its peers do not wait on it in the
    collective (it closes its group), and the job stops with the error, not a retry."""
    t0 = time.monotonic()
    with pytest.raises(UserCodeError, match="failed on w1 at step 6"):
        _with_fault(tmp_path, _OnOneRank(FAULT_STEP, "user_error"))
    assert time.monotonic() - t0 < 120
    evs = events(tmp_path)
    assert [f["kind"] for f in of(evs, "fault")] == ["user_code_error"]
    failed = [r for r in of(evs, "run_ahead") if r["ended"] == "failed"]
    assert [(r["committed"], r["behind"]) for r in failed] == [(FAULT_STEP, [])]


class _FailsAtStep:
    """The spec's dataset, raising for the samples of step ``step`` (the data plan's): a
    worker loads a step's samples while the previous step's all-reduce is in flight, and
    the error must still be that step's, after the one before it commits."""

    def __init__(self, s: planaria.TrainSpec, step: int) -> None:
        self.make, self.step = s.dataset, step
        self.ids = {int(i) for i in DataPlan(N, s.global_batch_size, s.seed).batch(step)}

    def __call__(self) -> Any:
        inner, step, ids = self.make(), self.step, self.ids

        class Failing(type(inner)):  # type: ignore[misc]
            def __getitem__(self, i: int) -> Any:
                if i in ids:
                    raise ValueError(f"sample {i} of step {step} cannot be read")
                return super().__getitem__(i)

        inner.__class__ = Failing
        return inner


def test_a_dataset_error_loaded_during_the_reduction_is_the_next_steps(tmp_path):
    s = spec()
    failing = dataclasses.replace(s, dataset=_FailsAtStep(s, FAULT_STEP))
    with pytest.raises(UserCodeError, match=f"of step {FAULT_STEP} cannot be read"):
        fit(failing, steps=STEPS, replicas=2, run_dir=tmp_path)
    evs = events(tmp_path)
    assert [e["step"] for e in of(evs, "step_committed")] == list(range(FAULT_STEP))
    assert [f["kind"] for f in of(evs, "fault")] == ["user_code_error"]


class _SlowLoss:
    """The spec's loss, taking at least ``seconds`` a micro-batch (same math)."""

    def __init__(self, loss: Any, seconds: float) -> None:
        self.loss, self.seconds = loss, seconds

    def __call__(self, model: Any, batch: Any) -> Any:
        end = time.monotonic() + self.seconds
        out = self.loss(model, batch)
        while time.monotonic() < end:
            time.sleep(0.005)
        return out


class _SlowUntilJoined(_SlowLoss):
    """As _SlowLoss, and ten times slower while ``marker`` exists (the test removes it when
    the replacement joins): the survivors' run outlasts a replacement's start however
    loaded the machine is, and the rest of the job goes at the usual pace."""

    def __init__(self, loss: Any, seconds: float, marker: str) -> None:
        super().__init__(loss, seconds)
        self.marker = marker

    def __call__(self, model: Any, batch: Any) -> Any:
        if os.path.exists(self.marker):
            time.sleep(9 * self.seconds)
        return super().__call__(model, batch)


LONG = 48


@pytest.fixture(scope="module")
def reference_long(tmp_path_factory, ray_cluster):
    return fit(spec(), steps=LONG, replicas=1,
               run_dir=tmp_path_factory.mktemp("ref_long")).state_dict


def test_a_replacement_ends_a_run_early_and_joins(tmp_path, reference_long):
    """A kill; the replacement becomes ready while the survivors run ahead: the
    controller's stop request (one store key, carried on the all-reduce) ends their run
    and the replacement joins at that boundary. Nothing else may end a run here (no
    checkpoint by time, whose stop could admit the joiner first), so the join's own
    stop is what is tested."""
    marker = tmp_path / "until-joined"
    marker.touch()
    slow = dataclasses.replace(spec(), loss=_SlowUntilJoined(spec().loss, 0.05, str(marker)))
    received: list[tuple[str, Any, float]] = []  # what a progress display would see, when

    def listen(record: dict) -> None:
        received.append((record["event"], record.get("start", record.get("step")), time.time()))
        if record["event"] == "joined":
            marker.unlink(missing_ok=True)

    # A cold start (~2 s): a warm one can be ready before the survivors' next run begins,
    # and then joins at that boundary with no run to stop.
    result = fit(slow, steps=LONG, replicas=3, run_dir=tmp_path, ledger=True,
                 chaos="kill:w2@step3", listeners=[listen], warm_start=False)
    assert_same_state(reference_long, result.state_dict)
    assert_exactly_once(tmp_path, num_samples=N, global_batch_size=G, steps=LONG)
    evs = events(tmp_path)
    runs = of(evs, "run_ahead")
    stopped = [r for r in runs if r["ended"] == "stop"]
    assert any(r["why"] == "join" for r in stopped), runs
    assert of(evs, "joined"), "the replacement must have joined"
    assert of(evs, "step_committed")[-1]["width"] == 3
    # Steps reach the listeners while their run goes on (rank 0 streams them), not only
    # when it ends: in the longest run, some step was seen well before the run's end.
    longest = max(runs, key=lambda r: r["steps"])
    assert longest["steps"] >= 8, runs
    end_t = next(t for ev, start, t in received if ev == "run_ahead" and start == longest["start"])
    seen_t = [t for ev, step, t in received if ev == "step_committed"
              and longest["start"] <= step < longest["start"] + longest["steps"]]
    assert min(seen_t) < end_t - 0.5, (min(seen_t), end_t)


def test_a_checkpoint_due_by_time_ends_a_run(tmp_path, reference_long):
    """A save decided by time cannot be planned as a step count: the controller's stop
    request ends the run at the next boundary, the save is taken there, and the state is
    the fault-free run's."""
    slow = dataclasses.replace(spec(), loss=_SlowLoss(spec().loss, 0.05))
    result = fit(slow, steps=LONG, replicas=2, run_dir=tmp_path,
                 checkpoint=CheckpointConfig(every="1s"))
    assert_same_state(reference_long, result.state_dict)
    evs = events(tmp_path)
    runs = of(evs, "run_ahead")
    assert any(r["ended"] == "stop" and r["why"] == "checkpoint" for r in runs), runs
    saved = [e["step"] for e in of(evs, "checkpoint_saved")]
    assert any(0 < s < LONG for s in saved), saved


class _ManyMetrics:
    """The spec's loss, with more metrics than the gradient buffer's status tail holds."""

    def __init__(self, loss: Any, count: int) -> None:
        self.loss, self.count = loss, count

    def __call__(self, model: Any, batch: Any) -> Any:
        out = self.loss(model, batch)
        loss = out[0] if isinstance(out, tuple) else out
        return loss, {f"m{i}": float(i) + 0.25 for i in range(self.count)}


@pytest.mark.parametrize("count", [2, 40])
def test_the_status_carries_the_metrics_in_the_gradients_reduce_or_beside_it(tmp_path, count):
    """A few metrics ride in the gradient buffer's tail (one collective a step); more than
    it holds are reduced on their own: either way every step's means are the loss's."""
    from planaria.worker import STATUS_TAIL

    assert (4 + count <= STATUS_TAIL) == (count == 2)
    many = dataclasses.replace(spec(), loss=_ManyMetrics(spec().loss, count))
    fit(many, steps=6, replicas=2, run_dir=tmp_path)
    evs = events(tmp_path)
    assert any(r["steps"] > 1 for r in of(evs, "run_ahead"))
    for ev in of(evs, "step_committed"):
        assert ev["metrics"] == {f"m{i}": float(i) + 0.25 for i in range(count)}, ev["step"]
