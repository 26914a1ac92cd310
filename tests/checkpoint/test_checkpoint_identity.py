"""Run identity without Ray: lineage in markers, retention by lineage, the root's lease, the
fit of a checkpoint to a job, the auto interval against slow saves, root validation."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from planaria.checkpoint import (
    CheckpointInterval,
    apply_retention,
    commit_checkpoint,
    list_checkpoints,
    plan_shards,
    take_share,
    write_shard,
)
from planaria.checkpoint.compat import compare_data_plans, compare_layouts
from planaria.checkpoint.config import CheckpointConfig
from planaria.checkpoint.errors import LeaseHeld
from planaria.checkpoint.lease import ProcessIdentity, RootLease
from planaria.checkpoint.restore import read_run_id
from planaria.checkpoint.storage import Storage
from planaria.faults.errors import ConfigError


def run_save(root: str, step: int, run_id: str) -> str:
    state = {"w": torch.full((8, 4), float(step))}
    (plan,) = plan_shards({k: (v.shape, v.dtype) for k, v in state.items()}, 1)
    rec = write_shard(root, step, 0, 1, take_share(state, plan), save_id=f"s{step}")
    return commit_checkpoint(root, step, [rec], {"steps_done": step}, world_size=1,
                             run_id=run_id)


def test_retention_ranks_only_its_own_lineage(tmp_path: Path) -> None:
    root = str(tmp_path)
    for step in (900, 1000, 1100):
        run_save(root, step, "old")
    for step in (100, 200, 300):
        run_save(root, step, "new")
    assert read_run_id(os.path.join(root, "step_000000100")) == "new"
    # Ranked by step over the whole root, the new run's checkpoints would all go.
    deleted = apply_retention(root, keep_last=2, verify_newest=False, run_ids={"new"})
    assert deleted == [100]
    assert [c.step for c in list_checkpoints(root)] == [200, 300, 900, 1000, 1100]


def test_lease_is_exclusive_and_fenced(tmp_path: Path) -> None:
    st = Storage(str(tmp_path))
    first = RootLease(st, "run-a", ttl_s=60)
    assert first.acquire() is None
    first.set_lineage(("run-0", "run-a"))
    second = RootLease(st, "run-b", ttl_s=60)
    with pytest.raises(LeaseHeld, match="run-a"):
        second.acquire()
    first.release()
    prev = second.acquire()
    assert prev is not None and prev.lineage == ("run-0", "run-a") and second.epoch == 2
    with pytest.raises(LeaseHeld, match="run-b"):
        first.renew()  # fenced: a commit of run-a now fails before its marker is written


def _write_lease(root: Path, **fields: object) -> None:
    import json
    import socket

    me = ProcessIdentity.this_process()
    record = {"holder": "old-run", "host": socket.gethostname(), "pid": os.getpid(),
              "boot_id": me.boot_id, "pid_ns": me.pid_ns, "start": me.start, "epoch": 7,
              "expires_t": time.time() + 300, "ttl_s": 300, "lineage": ["run-0", "old-run"]}
    (root / "LEASE.json").write_text(json.dumps({**record, **fields}))


def test_a_reused_pid_is_not_taken_for_the_holder(tmp_path: Path) -> None:
    """A controller restarted in place with the same pid (a container's pid 1) finds the
    lease of its predecessor, valid for minutes and naming its own pid: the start time
    differs, so the holder is gone and the lease is taken at once, its lineage kept."""
    me = ProcessIdentity.this_process()
    if me.start is None:
        pytest.skip("no /proc/PID/stat here: process start times cannot be read")
    _write_lease(tmp_path, start=me.start - 1)
    lease = RootLease(Storage(str(tmp_path)), "new-run", ttl_s=30)
    t0 = time.monotonic()
    prev = lease.acquire()
    assert time.monotonic() - t0 < 1.0
    assert prev is not None and prev.holder == "old-run" and prev.lineage == ("run-0", "old-run")
    assert lease.epoch == 8  # fencing goes on from the predecessor's epoch
    _write_lease(tmp_path, pid=2**22 + 12345)  # a pid that does not run here
    assert RootLease(Storage(str(tmp_path)), "third", ttl_s=30).acquire() is not None


def test_a_live_holder_on_this_host_is_refused(tmp_path: Path) -> None:
    _write_lease(tmp_path)  # this very process, with its own start time: alive
    with pytest.raises(LeaseHeld, match=r"old-run.*runs on this host"):
        RootLease(Storage(str(tmp_path)), "new-run", ttl_s=30).acquire()


def test_another_host_s_stale_lease_is_taken_within_its_ttl(tmp_path: Path) -> None:
    """A lease of a controller on another host, not renewed: this one cannot check that
    process, watches the lease for at most its ttl (not the minutes it claims to have
    left), then takes it."""
    _write_lease(tmp_path, host="elsewhere", ttl_s=1.5)  # says it is valid for 300 s more
    lease = RootLease(Storage(str(tmp_path)), "new-run", ttl_s=30)
    t0 = time.monotonic()
    prev = lease.acquire()
    waited = time.monotonic() - t0
    assert prev is not None and prev.holder == "old-run" and lease.epoch == 8
    assert 1.4 < waited < 3.0, waited


def test_another_host_s_live_lease_is_refused(tmp_path: Path) -> None:
    """A controller on another host that renews its lease (its heartbeat, every ttl/3) is
    live: a second controller watching the lease sees it renewed and is refused."""
    st = Storage(str(tmp_path))
    other = ProcessIdentity(host="elsewhere", pid=1, boot_id="b", pid_ns="pid:[1]", start=5)
    holder = RootLease(st, "holder", ttl_s=1.5, identity=other)
    holder.acquire()
    holder.start_heartbeat()
    try:
        t0 = time.monotonic()
        with pytest.raises(LeaseHeld, match=r"holder.*renewed while this controller waited"):
            RootLease(st, "second", ttl_s=30).acquire()
        assert time.monotonic() - t0 < 1.5  # seen renewed within one beat (0.5 s)
        holder.check()  # still the holder's, at its epoch
    finally:
        holder.release()
    assert RootLease(st, "second", ttl_s=30).acquire() is not None  # released: free


def test_the_heartbeat_keeps_the_lease_fresh(tmp_path: Path) -> None:
    st = Storage(str(tmp_path))
    lease = RootLease(st, "run-a", ttl_s=0.6)
    lease.acquire()
    first = lease.read()
    lease.start_heartbeat()
    try:
        end = time.monotonic() + 5
        while (cur := lease.read()) == first and time.monotonic() < end:
            time.sleep(0.05)
        assert cur is not None and first is not None and cur.expires_t > first.expires_t
        assert cur.epoch == first.epoch and lease.lost is None
    finally:
        lease.release()
    assert lease.read() is not None and lease.read().expires_t == 0.0  # type: ignore[union-attr]


def test_compare_layouts_names_the_tensors() -> None:
    saved = {"model/0.weight": ((128, 32), "F32"), "model/0.bias": ((128,), "F32"),
             "optim/0/step": ((), "F32")}
    live = {"model/0.weight": ((64, 32), "F32"), "model/0.bias": ((128,), "BF16"),
            "model/5.weight": ((1, 1), "F32")}
    diff = compare_layouts(saved, live)
    assert diff == [
        "not in the checkpoint: model/5.weight",
        "in the checkpoint but not in the job: optim/0/step",
        "shape differs: model/0.weight (checkpoint [128, 32], job [64, 32])",
        "dtype differs: model/0.bias (checkpoint F32, job BF16)",
    ]
    assert compare_layouts(saved, saved) == []
    plan = {"num_samples": 512, "global_batch_size": 64, "seed": 0}
    assert compare_data_plans(plan, plan) == []
    assert compare_data_plans(plan, {**plan, "num_samples": 500}) == [
        "num_samples: checkpoint 512, job 500"]
    assert compare_data_plans(None, plan) == []


def test_auto_interval_is_never_below_the_save_time() -> None:
    iv = CheckpointInterval.from_spec("auto", stall_prior_s=0.01, mtbf_prior_s=10.0)
    iv.observe_step_time(0.1)
    assert iv.interval_s() == pytest.approx((2 * 0.01 * 10.0) ** 0.5, rel=0.2)
    iv.observe_save_time(5.0)  # a save takes longer than Daly's optimum
    assert iv.interval_s() == 5.0 and iv.steps() == 50
    cont = CheckpointInterval.from_spec("auto", stall_prior_s=0.01, mtbf_prior_s=10.0,
                                        continuous=True)
    cont.observe_step_time(0.1)
    cont.observe_save_time(5.0)
    assert cont.interval_s() == 0.0 and cont.steps() == 1


def test_root_validation() -> None:
    with pytest.raises(ConfigError, match="memory://"):
        CheckpointConfig(root="memory://x")
    for bad in ({"on_other_run": "merge"}, {"storage_attempts": 0}, {"lease_ttl_s": 0}):
        with pytest.raises(ConfigError):
            CheckpointConfig(**bad)  # type: ignore[arg-type]


def test_scheduler_state_is_loaded_only_into_its_own_keys() -> None:
    from planaria.worker.state import flatten_state, load_state

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    tensors, meta = flatten_state(model, opt, sched)
    meta["scheduler"] = {**meta["scheduler"], "last_epoch": 7, "optimizer": "not yours"}
    load_state(model, opt, sched, tensors, meta)
    assert sched.last_epoch == 7 and sched.optimizer is opt


def test_strategy_follows_the_replicas_topology(tmp_path: Path) -> None:
    from planaria.checkpoint.coordinator import Checkpointer
    from tests.checkpoint_host import FakeHost, as_host

    def strategy(nodes: list[str], **cfg: object) -> str:
        host = FakeHost(tmp_path, tuple(f"w{i}" for i in range(len(nodes))), nodes=tuple(nodes))
        ck = Checkpointer(as_host(host), CheckpointConfig(**cfg))  # type: ignore[arg-type]
        try:
            return ck.restorer.strategy()
        finally:
            ck.close()

    assert strategy(["a", "a", "a"]) == "read_all"
    assert strategy(["a", "b", "a"]) == "share"
    assert strategy(["a", "a"], restore_strategy="share") == "share"
    assert strategy(["a", "b"], strict=False) == "read_all"


def test_relative_root_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from planaria.checkpoint.coordinator import Checkpointer
    from tests.checkpoint_host import FakeHost, as_host

    monkeypatch.chdir(tmp_path)
    ck = Checkpointer(as_host(FakeHost("x")), CheckpointConfig(root="ckpts"))
    assert ck.root == str(tmp_path / "ckpts")
    ck.close()


def test_a_lease_renewal_on_a_full_disk_leaves_the_lease_as_it_was(tmp_path):
    """A renewal that fails part-way (ENOSPC, on a file system whose writes are not atomic)
    leaves the lease record whole: the job still holds it, its commits' checks pass, and it
    renews again once the disk has room (a torn record read as no lease at all, and every
    later save of the job failed to commit)."""
    from planaria.faults.campaign import storage_faults

    control = tmp_path / "control"
    control.mkdir()
    st = Storage(f"faulty://{tmp_path}/root", {"control": str(control)})
    lease = RootLease(st, "run-a", ttl_s=60)
    lease.acquire()
    before = lease.read()
    storage_faults.fill(control, fault_id="full")
    with pytest.raises(OSError, match="no space left"):
        lease.renew()
    assert lease.read() == before
    lease.check()  # still this run's, at its epoch
    storage_faults.free(control)
    lease.renew()
    after = lease.read()
    assert after is not None and after.epoch == before.epoch and after.expires_t > before.expires_t
    assert not [p for p in st.listdir(st.root) if p.endswith(".tmp")]  # no partial record left


def test_an_uncommitted_saves_files_on_an_object_store_are_removed_and_a_committed_ones_kept(
        tmp_path):
    """A save that will not commit (its writer failed on a full disk) leaves files under its
    step's prefix on an object store: they are removed in the run; the save the step's
    marker commits is never touched."""
    import planaria.faults.campaign.storage_faults  # noqa: F401 (registers faulty://)
    from planaria.checkpoint.newest import latest_viable
    from planaria.checkpoint.retention import remove_uncommitted_save
    from tests.checkpoint.test_checkpoint_roundtrip import make_state, save

    control = tmp_path / "control"
    control.mkdir()
    options = {"control": str(control)}
    root = f"faulty://{tmp_path}/root"
    save(root, 4, make_state(4), 2, storage_options=options)
    st = Storage(root, options)
    step_dir = tmp_path / "root" / "step_000000004"
    committed = [p.name for p in step_dir.iterdir() if p.name.startswith("save-")]
    failed = step_dir / "save-0123456789ab"
    failed.mkdir()
    (failed / "save.json").write_text('{"torn')  # what ENOSPC part-way left
    assert not remove_uncommitted_save(st, 4, committed[0].removeprefix("save-"))
    assert remove_uncommitted_save(st, 4, "0123456789ab")
    assert not failed.exists()
    path, _ = latest_viable(root, lineage=[None], storage_options=options)
    assert path is not None and path.endswith("step_000000004")
