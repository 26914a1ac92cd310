"""Smoke test of the benchmark baselines' runners (real torchrun processes on 127.0.0.1)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for bench


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_run_ddp_steady_tiny(tmp_path):
    from bench.baselines.runners import run_ddp_steady

    # Twice in one workdir: the second run's figures are its own steps alone.
    for _ in range(2):
        out = run_ddp_steady(steps=6, size="tiny", nproc=2, threads=1, timeout_s=180,
                             workdir=tmp_path)

        assert len(out["step_ms"]) == 6 - 3  # warm-up steps left out
        assert len(out["period_ms"]) == 6 - 3 - 1
        assert all(math.isfinite(ms) and 0 < ms < 60_000 for ms in out["period_ms"])
        assert out["step_ms_median"] > 0


def test_batch_ids_is_a_permutation_per_epoch():
    import numpy as np

    from bench import common

    n, g = 256, 64
    ids = np.concatenate([common.batch_ids(s, g, n, seed=3) for s in range(n // g)])
    assert sorted(ids.tolist()) == list(range(n))
    parts = [common.split_ids(common.batch_ids(5, g, n, 3), r, 3) for r in range(3)]
    assert np.concatenate(parts).tolist() == common.batch_ids(5, g, n, 3).tolist()


def test_a_launch_that_lost_its_port_is_retried_and_other_failures_are_not(tmp_path):
    from bench.baselines import runners

    def launcher(first_words: str):
        launches = []

        def cmd():
            launches.append(1)
            # The first launch prints ``first_words`` and fails; the next ones succeed.
            code = f"import sys; print({first_words!r}); sys.exit(1)" if len(launches) == 1 else ""
            return [sys.executable, "-c", code]

        return cmd, launches

    cmd, launches = launcher("DistNetworkError: ... code: -98, name: EADDRINUSE")
    log = tmp_path / "a.log"
    runners._run_torchrun_to_end(cmd, {}, log, 60, "job", "x.py", tmp_path / "none.jsonl")
    assert len(launches) == 2

    cmd, launches = launcher("ValueError: the model is wrong")
    log = tmp_path / "b.log"
    with pytest.raises(RuntimeError, match="the model is wrong"):  # the log's tail is in it
        runners._run_torchrun_to_end(cmd, {}, log, 60, "job", "x.py", tmp_path / "none.jsonl")
    assert len(launches) == 1
