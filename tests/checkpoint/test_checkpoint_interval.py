"""The checkpoint interval: Daly's published cases, fixed, duration and auto modes."""

from __future__ import annotations

import pytest

from planaria.checkpoint import CheckpointInterval, young_daly_interval

MIN = 60.0
HOUR = 3600.0


@pytest.mark.parametrize(
    ("mtbf_s", "expected_min", "tol_min"),
    [(24 * HOUR, 117.0, 0.5), (6 * HOUR, 57.0, 0.5), (15 * MIN, 9.1, 0.05)],
)
def test_daly_published_cases(mtbf_s: float, expected_min: float, tol_min: float) -> None:
    assert young_daly_interval(5 * MIN, mtbf_s) / MIN == pytest.approx(expected_min, abs=tol_min)


def test_daly_limits() -> None:
    assert young_daly_interval(10.0, 4.0) == 4.0  # delta >= 2M: the MTBF itself
    assert young_daly_interval(0.0, 100.0) == 0.0
    young = (2 * 1.0 * 1e6) ** 0.5
    assert young_daly_interval(1.0, 1e6) == pytest.approx(young, rel=0.01)  # Young for small δ
    with pytest.raises(ValueError):
        young_daly_interval(-1.0, 10.0)
    with pytest.raises(ValueError):
        young_daly_interval(1.0, 0.0)


def test_fixed_steps() -> None:
    iv = CheckpointInterval(every_steps=10)
    due = [s for s in range(1, 35) if iv.should_save(s, now=0.0)]
    assert due == [10, 20, 30]
    iv.mark_saved(20, 0.0)
    assert not iv.should_save(20, 0.0)
    assert iv.describe()["every_steps"] == 10 and iv.describe()["reason"] == "fixed"


def test_duration() -> None:
    iv = CheckpointInterval.from_spec("10m")
    assert iv.every_s == 600
    assert not iv.should_save(1, now=1000.0)
    assert not iv.should_save(2, now=1599.0)
    assert iv.should_save(3, now=1600.0)
    iv.mark_saved(3, 1600.0)
    assert not iv.should_save(4, now=1700.0)


def test_auto_follows_stall_and_failures() -> None:
    iv = CheckpointInterval.from_spec("auto", mtbf_prior_s=24 * HOUR, stall_prior_s=5 * MIN)
    assert iv.steps() is None  # no step time yet: falls back on time
    iv.observe_step_time(60.0)
    assert iv.steps() == round(young_daly_interval(5 * MIN, iv.mtbf_s) / 60.0)
    before = iv.steps()
    for _ in range(3):
        iv.observe_failure()
    assert iv.mtbf_s == pytest.approx((24 * HOUR + 60.0) / 4)
    assert iv.steps() is not None and before is not None and iv.steps() < before
    iv.observe_stall(1.0)
    iv.observe_stall(1.0)
    smaller_stall = iv.steps()
    assert smaller_stall is not None and smaller_stall < before
    d = iv.describe()
    assert d["reason"] == "auto" and {"stall_s", "mtbf_s", "step_s", "every_steps"} <= set(d)
    n = iv.steps() or 0
    assert not iv.should_save(n - 1, now=0.0) and iv.should_save(n, now=0.0)


def test_auto_bounds_and_validation() -> None:
    iv = CheckpointInterval(auto=True, mtbf_prior_s=1e9, stall_prior_s=100.0, max_steps=50)
    iv.observe_step_time(0.1)
    assert iv.steps() == 50
    with pytest.raises(ValueError):
        CheckpointInterval()
    with pytest.raises(ValueError):
        CheckpointInterval(every_steps=5, auto=True)
    with pytest.raises(ValueError):
        CheckpointInterval.from_spec("sometimes")
    assert CheckpointInterval.from_spec(500).every_steps == 500
    assert CheckpointInterval.from_spec("2h").every_s == 7200
