"""The benches' statistics (bench/stats.py) and raw records (bench/records.py)."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import records, stats  # noqa: E402


def test_median_interval_covers_a_known_median_and_narrows_with_more_runs():
    rng = random.Random(1)
    small = [rng.gauss(10.0, 1.0) for _ in range(9)]
    large = [rng.gauss(10.0, 1.0) for _ in range(400)]
    a, b = stats.median_ci(small), stats.median_ci(large)
    assert a.ci95 is not None and b.ci95 is not None
    assert a.ci95[0] <= a.median <= a.ci95[1]
    assert b.ci95[0] < 10.0 < b.ci95[1]
    assert b.ci95[1] - b.ci95[0] < a.ci95[1] - a.ci95[0]
    assert a.median == statistics.median(small) and a.n == 9


def test_bootstrap_is_reproducible_and_uses_enough_resamples():
    values = [1.0, 2.0, 3.5, 4.0, 8.0]
    assert stats.median_ci(values) == stats.median_ci(values)
    assert stats.RESAMPLES >= 2000


def test_paired_ratio_keeps_runs_that_ran_side_by_side_together():
    # The machine's speed varies wildly between repeats, but within a repeat system A is
    # always 1.1 x system B: paired, the ratio is exactly 1.1; unpaired it would not be.
    rng = random.Random(2)
    machine = [rng.uniform(0.5, 2.0) for _ in range(8)]
    a = [1.1 * m for m in machine]
    paired = stats.paired_ratio(a, machine)
    assert paired.median == pytest.approx(1.1)
    assert paired.ci95 == pytest.approx((1.1, 1.1))
    unpaired = stats.median_ci([x / y for x, y in zip(a, reversed(machine), strict=True)])
    assert unpaired.ci95 is not None and unpaired.ci95[1] - unpaired.ci95[0] > 0.2


def test_paired_ratio_is_the_median_of_per_repeat_ratios_and_skips_missing():
    est = stats.paired_ratio([2.0, 3.0, None, 10.0], [1.0, 1.0, 1.0, 2.0])
    assert est.median == 3.0 and est.n == 3
    assert stats.paired_ratio([None], [1.0]) == stats.Estimate(median=None, ci95=None, n=0)
    with pytest.raises(ValueError):
        stats.paired_ratio([1.0], [1.0, 2.0])


def test_claims_need_the_whole_interval():
    ahead = stats.Estimate(median=1.05, ci95=(1.01, 1.09), n=5)
    tie = stats.Estimate(median=1.05, ci95=(0.99, 1.09), n=5)
    assert stats.ahead(ahead) is True and stats.ahead(tie) is False
    assert stats.ahead(stats.Estimate(median=None, ci95=None, n=0)) is None
    assert stats.met(ahead, 1.0, ">=") is True and stats.met(tie, 1.0, ">=") is False
    assert stats.met(tie, 1.09, "<=") is True and stats.met(tie, 1.05, "<=") is False
    with pytest.raises(ValueError):
        stats.met(tie, 1.0, "~")


def test_one_or_two_values_support_no_claim():
    one = stats.paired_ratio([1.04], [1.0])  # its interval is the value itself
    assert one.ci95 == (1.04, 1.04) and stats.ahead(one) is None
    assert stats.met(one, 1.0, ">=") is None
    two = stats.median_ci([1.2, 1.3])
    assert stats.ahead(two) is None and stats.met(two, 1.0, ">") is None


def test_raw_records_round_trip_and_large_ones_are_gzipped(tmp_path, monkeypatch):
    folder = records.raw_dir(tmp_path, "goodput", "fast", "a" * 40 + "-dirty")
    assert folder == tmp_path / "goodput" / "fast" / ("a" * 12 + "-dirty")
    small = records.write_raw(folder, "torchrun_ckpt5-r0", {"x": 1})
    monkeypatch.setattr(records, "GZIP_OVER_BYTES", 10)
    big = records.write_raw(folder, "planaria-r0", {"commits": list(range(100))})
    assert small.suffix == ".json" and big.name.endswith(".json.gz")
    assert records.read_raw(folder) == {"torchrun_ckpt5-r0": {"x": 1},
                                        "planaria-r0": {"commits": list(range(100))}}
    assert records.latest_raw_dir(tmp_path, "goodput", "fast") == folder
    assert records.latest_raw_dir(tmp_path, "goodput", "realistic") is None


def test_tree_commit_names_head():
    commit = records.tree_commit()
    assert commit is None or len(commit.removesuffix("-dirty")) == 40


def test_the_latest_folder_is_the_one_whose_runs_ended_last_whatever_the_files_times(tmp_path):
    """A fresh clone gives every file the time of the checkout, in no order: the records'
    own end times decide."""
    import os

    older = records.raw_dir(tmp_path, "goodput", "realistic", "b" * 40)
    newer = records.raw_dir(tmp_path, "goodput", "realistic", "c" * 40)
    records.write_raw(newer, "planaria-r0", {"t0": 2000.0, "t1": 3200.0})
    records.write_raw(older, "planaria-r0", {"t0": 1000.0, "t1": 2200.0})
    for path in newer.iterdir():  # written first: the files say the other folder is newer
        os.utime(path, (1, 1))
    assert records.latest_raw_dir(tmp_path, "goodput", "realistic") == newer
