"""The checkpoint bench's parts: its I/O helpers and DCP's worker group (its estimators are
bench.stats', tested with it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for bench


def test_raw_read_reads_every_file_or_the_suffixes_asked(tmp_path):
    from bench.checkpoint_io import checkpoint_files, make_cold, memcpy_s, raw_read

    (tmp_path / "a.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.distcp").write_bytes(b"y" * 300)
    assert raw_read(str(tmp_path)) == 1000
    assert raw_read(str(tmp_path), None) == 1300
    assert len(checkpoint_files(str(tmp_path))) == 2
    assert make_cold([str(tmp_path)]) in ("drop_caches", "fadvise_dontneed")
    assert memcpy_s(1 << 20) > 0


def test_raw_readers_read_every_file_once_per_reader_in_a_process_of_their_own(tmp_path):
    from bench.checkpoint_io import RawReaders

    (tmp_path / "a.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "b.distcp").write_bytes(b"y" * 300)
    readers = RawReaders(str(tmp_path), 2)
    try:
        assert readers.read() > 0 and readers.read() > 0  # timed in there, as often as asked
    finally:
        readers.close()
    assert not readers._proc.is_alive() and readers._proc.exitcode == 0


def test_summary_takes_the_per_repeat_differences_and_the_best_dcp_option():
    from bench.baselines.dcp_workers import SWEEP
    from bench.checkpoint import summarize

    sweep = SWEEP[:2]
    records: list[dict] = []
    for r in range(3):
        records.append({"kind": "memcpy", "repeat": r, "s": 0.01})
        for system, extra in (("planaria", 0.1), (f"dcp:{sweep[0].name}", 0.4),
                              (f"dcp:{sweep[1].name}", 0.2)):
            records.append({"kind": "run", "repeat": r, "system": system, "every": 0,
                            "wall_s": 1.0, "blocks_s": [], "saves": 0})
            records.append({"kind": "run", "repeat": r, "system": system, "every": 2,
                            "wall_s": 1.0 + 2 * extra, "blocks_s": [0.01, 0.02, 0.5],
                            "saves": 2})
        records.append({"kind": "restore", "repeat": r, "cold": "drop_caches",
                        "planaria_read_all_s": 2.0, "planaria_read_all_raw_s": 1.6,
                        "planaria_share_s": 1.0, "planaria_share_raw_s": 0.5,
                        "planaria_raw_s": 0.8, "planaria_raw_warm_s": 0.1,
                        "dcp_s": 4.0, "dcp_raw_s": 1.0, "dcp_one_read_s": 0.9})
    out = summarize(records, sweep, 3)

    assert out["planaria"]["extra_wall_per_save_s"]["median"] == pytest.approx(0.1)
    assert out["dcp"]["config"] == sweep[1].name
    assert out["ratios"]["extra_wall_dcp_over_planaria"]["median"] == pytest.approx(2.0)
    assert out["planaria"]["blocking_per_save_s"]["median"] == pytest.approx(0.02)
    assert out["ratios"]["planaria_blocking_over_memcpy"]["median"] == pytest.approx(2.0)
    # read_all (auto's choice on one node) against the reads at its parallelism, not the
    # better of read_all and share; one read of the checkpoint beside it
    assert out["planaria"]["restore_vs_raw"]["median"] == pytest.approx(0.8)
    assert out["planaria"]["share"]["restore_vs_raw"]["median"] == pytest.approx(0.5)
    assert out["planaria"]["restore_vs_one_read"]["median"] == pytest.approx(0.4)
    assert out["dcp"]["restore_vs_raw"]["median"] == pytest.approx(0.25)
    assert out["dcp"]["restore_vs_one_read"]["median"] == pytest.approx(0.225)
    assert out["targets"] == {"extra_wall_le_dcp": True, "blocking_le_1_5_memcpy": False,
                              "restore_ge_0_7_raw": True}
    assert out["page_cache_dropped"] is True


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_dcp_group_saves_from_every_rank_and_restores(tmp_path):
    from bench.baselines.dcp_workers import SWEEP, DcpGroup

    group = DcpGroup(2, "tiny")
    try:
        assert group.state_bytes > 0
        plain = group.run(2, 0, SWEEP[0], str(tmp_path))
        assert plain["saves"] == 0 and plain["last"] is None and plain["wall_s"] > 0
        saved = group.run(4, 2, SWEEP[0], str(tmp_path))
        assert saved["saves"] == 2 and all(b > 0 for b in saved["blocks_s"])
        files = os.listdir(saved["last"])
        assert ".metadata" in files and sum(f.endswith(".distcp") for f in files) == 2
        assert group.restore(saved["last"]) > 0
    finally:
        group.close()
