"""A faulty:// root's latency: set for the root's life, adjusted while the job runs."""

from __future__ import annotations


def test_a_faulty_root_s_latency_is_set_for_its_life_and_adjusted_while_it_runs(tmp_path):
    import time

    import fsspec

    from planaria.faults.campaign.storage_faults import set_latency, with_latency

    control = tmp_path / "control"
    control.mkdir()
    fs = fsspec.filesystem("faulty", control=str(control),
                           **with_latency(read=0.2, match="slow"))
    for name in ("slow", "fast"):
        with fs.open(f"faulty://{tmp_path}/{name}", "wb") as f:
            f.write(b"x")

    def took(path: str, mode: str = "rb") -> float:
        t0 = time.monotonic()
        with fs.open(f"faulty://{tmp_path}/{path}", mode) as f:
            f.write(b"y") if "w" in mode else f.read()
        return time.monotonic() - t0

    assert took("slow") >= 0.2 and took("fast") < 0.2  # the option: reads of "slow" only
    set_latency(control, write=0.3)  # adjusted while the root is open, for every path
    assert took("fast", "wb") >= 0.3 and took("fast") < 0.2
    set_latency(control)  # cleared
    assert took("fast", "wb") < 0.3 and not (control / "latency.json").exists()
