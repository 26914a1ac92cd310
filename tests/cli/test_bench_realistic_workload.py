"""The benchmark workload's realistic size and the overhead bench's estimator (no processes)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for bench


def test_the_realistic_size_holds_at_least_1_gb_of_training_state():
    from bench import common

    with torch.device("meta"):  # shapes only: no 338 MB allocated
        model = common.TokenMLP(common.SIZES["realistic"])
    params = sum(p.numel() for p in model.parameters())
    # parameters and Adam's two moments, 4 bytes each (state_bytes counts the same)
    assert params * 3 * 4 >= 1_000_000_000
    assert params >= common.FUSED_ADAM_FROM  # its Adam is the fused one


def test_a_size_with_embedding_tables_trains_on_ids_and_counts_its_state():
    from bench import common

    size = common.Size(tokens=3, dim=8, hidden=8, layers=1, vocab=20)
    model = common.TokenMLP(size)
    dataset = common.SyntheticDataset(16, 0, size)
    x, y = common.load_batch(dataset, range(4))
    assert x.dtype == torch.int64 and x.shape == (4, 3) and y.shape == (4,)
    assert common.load_batch(dataset, [2])[0].tolist() == [dataset[2][0].tolist()]  # (seed, i)
    optimizer = common.make_optimizer(model.parameters())
    assert not optimizer.defaults.get("fused")  # small: the default loop, as before
    common.loss_fn(model, (x, y)).backward()
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    assert len(model.tables) == 3
    # parameters + two moments (4 bytes each) + a step count per parameter tensor
    steps = sum(st["step"].numel() * st["step"].element_size()
                for st in optimizer.state.values())
    assert common.state_bytes(model, optimizer) == params * 3 * 4 + steps


def test_state_bytes_counts_buffers():
    from bench import common

    model = torch.nn.BatchNorm1d(4)  # 8 parameters, 9 buffer elements (one int64)
    assert common.state_bytes(model) == 8 * 4 + 8 * 4 + 8


def test_overhead_estimator_is_the_median_of_paired_ratios_with_a_bootstrap_interval():
    pytest.importorskip("ray")
    from bench import overhead

    rows = [{"planaria_step_ms": p, "ddp_step_ms": d, "planaria_step_ms_mean": p,
             "ddp_step_ms_mean": d, "ratio": p / d}
            for p, d in ((10.0, 10.0), (22.0, 20.0), (9.0, 10.0), (31.0, 30.0), (10.5, 10.0))]
    out = overhead.summarise_pair(rows)
    ratios = [r["ratio"] for r in rows]
    assert out["ratio"] == statistics.median(ratios) == pytest.approx(31 / 30)
    lo, hi = out["ratio_ci95"]
    assert min(ratios) <= lo <= out["ratio"] <= hi <= max(ratios)
    assert out["fixed_ms"] == 0.5  # the median of the paired differences
    assert out["train_step_ms"] is None and out["ratio_of_means"] == pytest.approx(82.5 / 80)
    assert overhead.bootstrap_ci95([2.0] * 7) == [2.0, 2.0]
