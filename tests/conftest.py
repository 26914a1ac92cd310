"""Shared fixtures: one local Ray for the whole session (starting Ray costs seconds)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def start_local_ray() -> None:
    """The session's local Ray (tests/control/test_cluster.py stops it and starts it again)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",  # not another Ray running on this machine
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


@pytest.fixture(scope="module")
def s3_options():
    """A moto S3 server on 127.0.0.1 (the workers inherit its credentials) and the storage
    options that reach it, with the bucket ``planaria-ckpt``."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import socket

    import s3fs
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp = pytest.MonkeyPatch()
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        mp.setenv(key, value)  # the workers inherit them
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing"}
    s3fs.S3FileSystem(**options).mkdir("planaria-ckpt")
    yield options
    server.stop()
    mp.undo()


@pytest.fixture(autouse=True)
def _planaria_logging_restored() -> Iterator[None]:
    """A test that runs the CLI installs planaria's log handler on the stream of the moment
    (pytest's capture, closed after the test): later tests' warnings must not go there."""
    import logging

    root = logging.getLogger("planaria")
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


EVENTS_SHOWN = 60  # the last events of each run a failed test wrote


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test (a timeout included) shows the end of every event log it wrote: what
    the job was doing when it failed, which the run directory under tmp_path no longer
    holds on a CI machine."""
    outcome = yield
    report = outcome.get_result()
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when != "call" or not report.failed or tmp is None:
        return
    for log in sorted(tmp.rglob("events.jsonl")):
        lines = log.read_text(errors="replace").splitlines()[-EVENTS_SHOWN:]
        report.sections.append((f"events: {log.relative_to(tmp)}", "\n".join(
            line[:400] for line in lines)))
