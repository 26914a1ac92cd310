"""Counts that must stay exact at any scale, without Ray: every committed step's loss kept
(a million steps in megabytes), a step's sample count summed exactly at any global batch,
and a skipped step's samples read as skipped, not trained."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import torch

from planaria.data.plan import DataPlan, Ledger
from planaria.faults.campaign.oracle import exactly_once
from planaria.observe.loss_history import LossHistory
from planaria.worker import FP32_EXACT_COUNT, STATUS_TAIL, status_in_tail


def test_every_committed_loss_is_kept_in_megabytes() -> None:
    tracemalloc.start()
    history = LossHistory()
    for step in range(1_000_000):
        history.append((step, 1.0 / (step + 1)))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(history) == 1_000_000 and history.nbytes <= 2 * 16 * 1_000_000
    assert peak < 40e6  # a list of a million tuples: ~100 MB
    assert history[0] == (0, 1.0) and history[-1] == (999_999, 1.0 / 1_000_000)
    assert history[:2] == [(0, 1.0), (1, 0.5)]
    assert history.steps.dtype == np.int64 and history.values.dtype == np.float64
    assert [s for s, _ in history[-3:]] == [999_997, 999_998, 999_999]
    assert LossHistory([(0, 2.0), (1, 1.0)]) == [(0, 2.0), (1, 1.0)]


def _reduce(parts: list[torch.Tensor]) -> torch.Tensor:
    """A sum over ranks in the tensors' own dtype, as the all-reduce does."""
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def test_sample_counts_stay_exact_at_any_global_batch() -> None:
    """In an fp32 gradient tail a step's sample count is exact only up to 2**24: a global
    batch of 2**24 + 2 split over three ranks sums to a wrong count there. Such a status
    goes beside the gradient in fp64, where the sum is exact."""
    counts = [FP32_EXACT_COUNT - 1, 2, 1]  # 2**24 + 2 samples, one rank's share each
    total = sum(counts)
    fp32 = _reduce([torch.tensor([float(c)], dtype=torch.float32) for c in counts])
    assert int(fp32.item()) != total  # what the tail would have reported
    fp64 = _reduce([torch.tensor([float(c)], dtype=torch.float64) for c in counts])
    assert int(fp64.item()) == total
    status_len = 4 + 2
    tail32 = torch.zeros(STATUS_TAIL, dtype=torch.float32)
    tail64 = torch.zeros(STATUS_TAIL, dtype=torch.float64)
    assert status_in_tail(tail32, status_len, global_batch_size=FP32_EXACT_COUNT - 1)
    assert not status_in_tail(tail32, status_len, global_batch_size=total)  # beside, fp64
    assert status_in_tail(tail64, status_len, global_batch_size=total)
    assert not status_in_tail(tail64, STATUS_TAIL + 1, global_batch_size=64)  # too long
    assert not status_in_tail(None, status_len, global_batch_size=64)
    # Below 2**24 every partial sum is a small enough integer: the fp32 tail is exact.
    small = [FP32_EXACT_COUNT // 2 - 1, FP32_EXACT_COUNT // 2 - 3, 3]
    assert int(_reduce([torch.tensor([float(c)]) for c in small]).item()) == sum(small)


def test_a_skipped_step_reads_as_skipped_not_trained(tmp_path: Path) -> None:
    plan = DataPlan(8, 4, seed=0)
    ledger = Ledger(tmp_path, run_id="r")
    for step in range(4):
        ids = plan.batch(step).tolist()
        ledger.served(step, gen=0, worker="w0", ids=ids[:2])
        ledger.served(step, gen=0, worker="w1", ids=ids[2:])
        ledger.commit(step, gen=0, skipped=step == 2)  # step 2: non-finite, skipped
    ledger.close()
    assert sorted(Ledger.committed(tmp_path)) == [0, 1, 3]
    assert Ledger.skipped(tmp_path) == {2: plan.batch(2).tolist()}
    once = exactly_once(Ledger.committed(tmp_path), plan, 4, skipped=Ledger.skipped(tmp_path))
    assert once.ok and once.skipped == 4 and not once.problems
    # Read as trained (before), the skipped step's samples would count as used.
    without = exactly_once(Ledger.committed(tmp_path), plan, 4)
    assert without.missing == 4 and "step 2 is not in the ledger" in without.problems
