"""A joiner's optimizer state in a shared-memory region that outlives its owner: claimed
by one process at a time, left to the next when its owner dies, removed at a clean end."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from planaria.worker import memory_reserve
from planaria.worker.optimizer_layout import (
    claim_region_for_state,
    move_state_into,
    prebuild_by_probe,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock, tmpfs")


TAG = "testjob"


@pytest.fixture(autouse=True)
def _swept(tmp_path):
    yield
    memory_reserve.sweep(TAG, 0.0, tmp_path)


def test_a_region_gives_aligned_tensors_of_its_file(tmp_path) -> None:
    region = memory_reserve.claim(1 << 20, TAG, tmp_path)
    assert region is not None and region.path.parent == tmp_path
    a = region.take(torch.Size([3, 5]), torch.float32)
    b = region.take(torch.Size([7]), torch.float64)
    assert b.data_ptr() % 64 == 0 and b.data_ptr() >= a.data_ptr() + a.nbytes
    b.fill_(2.5)
    mapped = torch.UntypedStorage.from_file(str(region.path), shared=True, nbytes=1 << 20)
    offset = b.data_ptr() - a.data_ptr()
    seen = torch.empty(0, dtype=torch.uint8).set_(mapped, offset, (b.nbytes,))
    assert torch.equal(seen.view(torch.float64), b)
    with pytest.raises(ValueError, match="is full"):
        region.take(torch.Size([1 << 20]), torch.float32)


def test_a_claimed_region_is_not_claimed_again(tmp_path) -> None:
    first = memory_reserve.claim(4096, TAG, tmp_path)
    second = memory_reserve.claim(4096, TAG, tmp_path)
    assert first is not None and second is not None and first.path != second.path


def test_a_dead_owners_region_goes_to_the_next_with_its_pages(tmp_path) -> None:
    """The first owner writes its memory and is killed; the next claim gets that file,
    whose pages still hold what it wrote (resident, not fresh)."""
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        from pathlib import Path
        from planaria.worker import memory_reserve
        region = memory_reserve.claim(1 << 20, {TAG!r}, Path({str(tmp_path)!r}))
        region.take(torch.Size([1 << 18]), torch.float32).fill_(7.1)
        print(region.path, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == -9, out.stderr
    dead = out.stdout.strip()
    region = memory_reserve.claim(1 << 20, TAG, tmp_path)
    assert region is not None and str(region.path) == dead
    assert torch.all(region.take(torch.Size([1 << 18]), torch.float32) == torch.tensor(7.1))


def test_a_child_forked_by_the_owner_does_not_keep_its_claim(tmp_path) -> None:
    """The owner forks a child (as a data loader does) that outlives it: the owner killed,
    the next claim gets its region while the child still runs."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        from pathlib import Path
        from planaria.worker import memory_reserve
        region = memory_reserve.claim(1 << 20, {TAG!r}, Path({str(tmp_path)!r}))
        if os.fork() == 0:
            os.setsid()
            sys.stdin.read()  # until the test closes the pipe
            os._exit(0)
        print(region.path, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        dead = proc.stdout.readline().strip()
        assert proc.wait(timeout=60) == -9
        region = memory_reserve.claim(1 << 20, TAG, tmp_path)
        assert region is not None and str(region.path) == dead and region.recycled
    finally:
        proc.stdin.close()  # the child ends


def test_a_bigger_free_region_is_taken_before_a_new_one(tmp_path) -> None:
    small = memory_reserve.claim(4096, TAG, tmp_path)
    big = memory_reserve.claim(1 << 20, TAG, tmp_path)
    assert small is not None and big is not None
    memory_reserve._held.remove(big)  # as if its owner died: its claim ends with its fd
    os.close(big.fd)
    again = memory_reserve.claim(8192, TAG, tmp_path)
    assert again is not None and again.path == big.path


def test_the_sweep_removes_the_jobs_regions_once_their_claims_end(tmp_path) -> None:
    """A holder still alive when the sweep starts: its region goes once it has exited;
    another job's region stays."""
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from planaria.worker import memory_reserve
        region = memory_reserve.claim(4096, {TAG!r}, Path({str(tmp_path)!r}))
        print(region.path, flush=True)
        sys.stdin.readline()
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdout.readline()
    mine = memory_reserve.claim(4096, TAG, tmp_path)
    other = memory_reserve.claim(4096, "otherjob", tmp_path)
    assert mine is not None and other is not None
    orphan = tmp_path / f"{memory_reserve._prefix(TAG)}99"
    orphan.write_bytes(b"\0" * 4096)
    holder.stdin.write("exit\n")
    holder.stdin.flush()  # it exits while the sweep waits on its claim
    assert memory_reserve.sweep(TAG, 30.0, tmp_path) == 3
    holder.wait()
    assert [p.name for p in tmp_path.iterdir()] == [other.path.name]
    memory_reserve.sweep("otherjob", 0.0, tmp_path)


def test_no_directory_no_region(tmp_path) -> None:
    assert memory_reserve.claim(4096, TAG, tmp_path / "missing") is None


def step_alike(pairs, x: torch.Tensor) -> None:
    """One optimizer step of each (model, optimizer) on the same input."""
    for model, opt in pairs:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


def test_an_adam_state_prebuilt_in_a_region_loads_a_real_state(tmp_path) -> None:
    """The joiner's path: state carved from a region, a source's state received into it and
    loaded (``Optimizer.load_state_dict`` keeps the tensors it is given): the region's
    memory is the state, and it trains as the source does."""
    torch.manual_seed(0)
    src, dst = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    o_src, o_dst = torch.optim.Adam(src.parameters()), torch.optim.Adam(dst.parameters())
    for _ in range(2):
        src(torch.randn(2, 8)).sum().backward()
        o_src.step()
    dst.load_state_dict(src.state_dict())
    assert prebuild_by_probe(o_dst, lambda n: memory_reserve.claim(n, TAG, tmp_path))
    region = memory_reserve._held[-1]
    sent = o_src.state_dict()
    received = {"param_groups": sent["param_groups"], "state": {}}
    for i, p in enumerate(dst.parameters()):
        live = o_dst.state[p]
        received["state"][i] = {k: live[k].copy_(v) if v.dim() else v.clone()
                                for k, v in sent["state"][i].items()}
    o_dst.load_state_dict(received)
    base = region.storage.data_ptr()
    ptrs = [v.data_ptr() - base for s in o_dst.state.values() for v in s.values() if v.dim()]
    assert len(ptrs) == 4 and all(0 <= x < region.storage.nbytes() for x in ptrs)
    step_alike(((src, o_src), (dst, o_dst)), torch.randn(2, 8))
    assert torch.equal(src.weight, dst.weight) and torch.equal(src.bias, dst.bias)


def test_a_first_steps_state_moved_into_a_region_trains_as_before(tmp_path) -> None:
    """A worker that is not a joiner: its region claimed before its first step, the state
    that step made moved into it (values and all); it trains as a twin left alone does."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    o_a, o_b = torch.optim.Adam(a.parameters()), torch.optim.Adam(b.parameters())
    place = claim_region_for_state(o_b, lambda n: memory_reserve.claim(n, TAG, tmp_path))
    assert place is not None and not place.region.recycled
    region = place.region
    x = torch.randn(2, 8)
    for model, opt in ((a, o_a), (b, o_b)):
        model(x).sum().backward()
        opt.step()
    assert move_state_into(o_b, place) == 2 * (8 * 4 + 4) * 4  # exp_avg, exp_avg_sq
    base, end = region.storage.data_ptr(), region.storage.data_ptr() + region.storage.nbytes()
    moved = [v for s in o_b.state.values() for v in s.values() if v.dim()]
    assert len(moved) == 4 and all(base <= v.data_ptr() < end for v in moved)
    for _ in range(2):
        step_alike(((a, o_a), (b, o_b)), torch.randn(2, 8))
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
