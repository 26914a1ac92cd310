"""Storage errors on read and on write: retried with backoff, then the previous checkpoint;
a StorageError of its own kind, never mistaken for a bug in user code."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from test_checkpoint_roundtrip import assert_same, make_state, save

from planaria.checkpoint import AsyncShardWriter, load_latest, plan_shards
from planaria.checkpoint.backoff import is_storage_error, with_retries
from planaria.faults.campaign.storage_faults import counted_failures
from planaria.faults.errors import StorageError, UserCodeError, classify


def root_of(tmp_path: Path) -> str:
    return f"faulty://{tmp_path}/root"


def test_read_error_is_retried_then_the_previous_checkpoint_is_used(tmp_path: Path) -> None:
    clean = counted_failures("setup", (), ())
    save(root_of(tmp_path), 1, make_state(0), 2, storage_options=clean)
    save(root_of(tmp_path), 2, make_state(1), 2, storage_options=clean)
    # One failed read of step 2: retried, step 2 loads.
    once = counted_failures(secrets.token_hex(4), ("read",), (3,))
    restored, warnings = load_latest(root_of(tmp_path), lineage=[None], storage_options=once,
                                     backoff_s=0.01)
    assert restored is not None and restored.step == 2 and warnings == []
    assert_same(restored.tensors, make_state(1))
    # Every read of step 2 fails: step 1 is used, and said so.
    always = counted_failures(secrets.token_hex(4), ("read",), tuple(range(1, 99)),
                           match="step_000000002")
    restored, warnings = load_latest(root_of(tmp_path), lineage=[None], storage_options=always,
                                     attempts=2, backoff_s=0.01)
    assert restored is not None and restored.step == 1
    assert_same(restored.tensors, make_state(0))
    assert "step 2" in warnings[0] and "injected I/O error" in warnings[0]


def test_write_error_is_retried_and_a_persistent_one_is_a_storage_error(tmp_path: Path) -> None:
    state = make_state()
    plan = plan_shards({n: (t.shape, t.dtype) for n, t in state.items()}, 1)[0]
    opts = counted_failures(secrets.token_hex(4), ("write",), (1,))
    writer = AsyncShardWriter(root_of(tmp_path), storage_options=opts)
    writer.start(3, state, plan, save_id="a")
    record = writer.result(timeout_s=60)
    assert record.step == 3 and record.file.size > 0
    opts = counted_failures(secrets.token_hex(4), ("write",), tuple(range(1, 10)))
    writer = AsyncShardWriter(root_of(tmp_path), storage_options=opts, attempts=2)
    writer.start(4, state, plan, save_id="b")
    with pytest.raises(StorageError, match="injected I/O error"):
        writer.result(timeout_s=60)
    writer.close(timeout_s=10)


def test_storage_errors_are_their_own_kind() -> None:
    assert is_storage_error(PermissionError("denied")) and is_storage_error(TimeoutError())
    assert not is_storage_error(ValueError("bug"))
    failure = classify({"w1": StorageError("s3 down")}, live_after=2, step=4)
    assert isinstance(failure, StorageError) and not isinstance(failure, UserCodeError)
    assert failure.workers == ()
    calls = []

    def flaky() -> int:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return 7

    assert with_retries(flaky, what="x", backoff_s=0.001) == 7
    with pytest.raises(ZeroDivisionError):
        with_retries(lambda: 1 // 0, what="x")


def test_a_marker_read_error_neither_hides_a_checkpoint_nor_starts_over(tmp_path: Path) -> None:
    """The controller reads each committed checkpoint's marker to know whose it is: a
    transient error is retried (it once made a rollback find "no checkpoint saved yet" and
    give up), and markers that stay unreadable are an error, never a start from step 0."""
    from planaria.checkpoint import list_checkpoints
    from planaria.checkpoint.errors import NoViableCheckpoint
    from planaria.checkpoint.layout import MARKER
    from planaria.checkpoint.newest import lineage_checkpoints
    from planaria.checkpoint.restore import read_run_id

    clean = counted_failures("marker-setup", (), ())
    save(root_of(tmp_path), 3, make_state(0), 2, storage_options=clean)
    (info,) = list_checkpoints(root_of(tmp_path), storage_options=clean)
    lineage = (read_run_id(info.path, storage_options=clean),)
    options = counted_failures(secrets.token_hex(4), ("read",), (1,), match=MARKER)
    found = lineage_checkpoints(root_of(tmp_path), lineage, storage_options=options, attempts=3)
    assert [c.step for c in found.candidates] == [3]
    options = counted_failures(secrets.token_hex(4), ("read",), tuple(range(1, 99)), match=MARKER)
    with pytest.raises(NoViableCheckpoint, match=r"markers of 1 committed checkpoints .* could "
                                                 r"not be read"):
        lineage_checkpoints(root_of(tmp_path), lineage, storage_options=options, attempts=3)
