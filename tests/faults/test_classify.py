"""Whose fault is it: the one function that classifies faults, both ways."""

from __future__ import annotations

import pytest

from planaria.faults.errors import (
    AllReplicasLost,
    InfrastructureError,
    InternalError,
    StaleGeneration,
    StepAborted,
    UserCodeError,
    WorkerLost,
    classify,
)
from planaria.faults.user_code import is_infrastructure_error, user_call


@pytest.mark.parametrize(
    "err",
    [
        OSError(5, "Input/output error"),
        TimeoutError("read timed out"),
        PermissionError("denied"),
        MemoryError(),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("uncorrectable ECC error encountered"),
    ],
)
def test_infrastructure_errors_under_user_code_are_not_the_users(err):
    assert is_infrastructure_error(err)
    with pytest.raises(InfrastructureError) as info:
        user_call("the loss function", _raise, err)
    assert "Traceback" in str(info.value) and type(err).__name__ in str(info.value)


@pytest.mark.parametrize(
    "err", [ValueError("bad shape"), KeyError("x"), RuntimeError("mat1 and mat2 shapes differ")]
)
def test_bugs_in_user_code_are_the_users(err):
    assert not is_infrastructure_error(err)
    with pytest.raises(UserCodeError):
        user_call("the loss function", _raise, err)


def _raise(err: BaseException) -> None:
    raise err


def test_planaria_invariant_violations_are_never_blamed_on_the_user():
    failure = classify({"w1": StaleGeneration("w1 is in generation 4")}, live_after=2, step=3)
    assert isinstance(failure, InternalError) and failure.workers == ("w1",)
    failure = classify({"w0": AssertionError("step before join")}, live_after=2, step=3)
    assert isinstance(failure, InternalError) and not isinstance(failure, UserCodeError)


def test_an_aborted_step_is_a_consequence_never_a_cause():
    from ray.exceptions import ActorDiedError

    errors = {"w0": StepAborted("w0 abandoned step 3"), "w1": ActorDiedError()}
    failure = classify(errors, live_after=1, step=3)
    assert isinstance(failure, WorkerLost) and failure.workers == ("w1",)
    only_aborts = classify({"w0": StepAborted("x")}, live_after=2, step=3)
    assert isinstance(only_aborts, WorkerLost) and only_aborts.workers == ()


def test_a_user_error_wins_over_an_infrastructure_error_and_both_over_aborts():
    user = UserCodeError("loss raised ValueError", workers=("w2",))
    infra = InfrastructureError("dataset[i] raised OSError", workers=("w1",))
    errors = {"w0": StepAborted("x"), "w1": infra, "w2": user}
    assert isinstance(classify(errors, live_after=2, step=1), UserCodeError)
    failure = classify({"w0": StepAborted("x"), "w1": infra}, live_after=2, step=1)
    assert isinstance(failure, InfrastructureError) and failure.workers == ("w1",)
    assert isinstance(classify({"w1": infra}, live_after=0, step=1), AllReplicasLost)


def test_traceback_failures_survive_pickling():
    import pickle

    err = InfrastructureError("x", remote_traceback="tb", workers=("w1",), step=3)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is InfrastructureError
    assert (back.remote_traceback, back.workers, back.step) == ("tb", ("w1",), 3)
