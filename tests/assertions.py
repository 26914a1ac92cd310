"""Assertions shared by the fault tests: exactly-once data and equal final state."""

from __future__ import annotations

import os


def assert_exactly_once(
    run_dir: os.PathLike[str] | str, *, num_samples: int, global_batch_size: int, steps: int
) -> None:
    """Each committed step trained its planned batch; every sample was used once per epoch."""
    from collections import Counter
    from pathlib import Path

    from planaria.data_plan import DataPlan, Ledger

    ledger = Ledger.read(Path(run_dir))
    assert sorted(ledger) == list(range(steps)), f"steps in ledger: {sorted(ledger)}"
    plan = DataPlan(num_samples, global_batch_size, seed=0)
    stream: list[int] = []
    for step in range(steps):
        ids = ledger[step]
        assert sorted(ids) == sorted(plan.batch(step).tolist()), (
            f"step {step} trained other samples"
        )
        stream += ids
    full_epochs = len(stream) // num_samples
    for epoch in range(full_epochs):
        counts = Counter(stream[epoch * num_samples : (epoch + 1) * num_samples])
        assert len(counts) == num_samples and set(counts.values()) == {1}
    tail = Counter(stream[full_epochs * num_samples :])
    assert not tail or set(tail.values()) == {1}


def assert_same_state(a: dict, b: dict, *, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(
            a[key], b[key], atol=atol, rtol=rtol, msg=lambda m, k=key: f"{k}: {m}"
        )
