"""Shared fixtures: one local Ray for the whole session (starting Ray costs seconds)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def start_local_ray() -> None:
    """The session's local Ray (tests/test_cluster.py stops it and starts it again)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=8,
            include_dashboard=False,
            configure_logging=False,
            log_to_driver=False,
        )


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    import ray

    start_local_ray()
    yield
    ray.shutdown()
