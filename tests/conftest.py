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


EXTENDED_VARIANTS = frozenset({
    # A second or third variant of a scenario another test of the same function (or file)
    # keeps in the default suite, moved to ``-m extended`` to keep the default suite short.
    "tests/control/test_fleet_preemption.py::test_a_reclaim_wave_inside_a_step_is_saved_and_restored[sharded-replicas]",
    "tests/control/test_fleet_preemption.py::test_a_reclaim_wave_inside_a_step_is_saved_and_restored[short-steps]",
    "tests/control/test_ray_daemons.py::test_the_raylet_killed_mid_run_ends_the_job_with_a_save_and_leaves_nothing[cold]",
    "tests/control/test_ray_daemons.py::test_a_sigkilled_controller_leaves_no_process_of_its_job[group]",
    "tests/control/test_ray_daemons.py::test_the_raylet_of_a_cluster_killed_ends_the_job_and_leaves_its_gcs_alone",
    "tests/worker/test_sharded.py::test_a_fault_of_one_worker_takes_its_replica_out[hang-follower-before-reduce]",
    "tests/worker/test_sharded.py::test_a_fault_of_one_worker_takes_its_replica_out[preempt-follower]",
    "tests/worker/test_sharded.py::test_a_sharded_checkpoint_restores_at_another_k[into-2x1]",
    "tests/worker/test_sharded.py::test_a_sharded_checkpoint_restores_at_another_k[into-1x4]",
    "tests/control/test_autonomous.py::test_a_fault_after_the_reduction_keeps_the_step[preempt]",
    "tests/control/test_autonomous.py::test_a_fault_at_each_phase_of_the_loop[kill-loaded]",
    "tests/control/test_autonomous.py::test_a_fault_at_each_phase_of_the_loop[hang-applied]",
    "tests/control/test_autonomous.py::test_the_status_carries_the_metrics_in_the_gradients_reduce_or_beside_it[40]",
    "tests/checkpoint/test_durable_saves.py::test_a_controller_killed_after_a_save_was_written_restores_that_save[steps_after]",
    "tests/checkpoint/test_checkpoint_trust.py::test_every_replica_lost_and_no_checkpoint_restores[True]",
    "tests/checkpoint/test_checkpointing.py::test_restore_at_any_width[1-read_all]",
    "tests/data/test_dataset_randomness.py::test_an_augmenting_dataset_trains_the_same_at_any_width_and_through_a_kill[torch-inline]",
    "tests/data/test_dataset_randomness.py::test_only_a_dataset_drawing_from_the_globals_loses_the_loader_thread[quiet]",
    "tests/integrations/test_lightning.py::test_fit_lightning_returns_fits_result_with_the_metrics",
    "tests/integrations/test_lightning.py::test_manual_optimization_is_refused_from_the_workers",
    "tests/integrations/test_lightning.py::test_the_example_runs_with_a_kill",
    "tests/integrations/test_transformers.py::test_the_example_runs_with_a_kill",
    "tests/control/test_evaluation.py::test_the_eval_collate_batches_the_eval_set_and_the_training_keeps_its_own",
    "tests/control/test_evaluation.py::test_a_sharded_replica_evaluates_with_its_workers_together",
})


def _long_tests() -> frozenset[str]:
    from pathlib import Path

    path = Path(__file__).with_name("long_tests.txt")
    return frozenset(line.strip() for line in path.read_text().splitlines()
                     if line.strip() and not line.startswith("#"))


LONG_TESTS = _long_tests()
"""Tests of more than ~10 s each (tests/long_tests.txt, written by tests/long_tests.py from a
timed run): ``long``, out of the default suite, run by ``.ci/run`` after it."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks :data:`EXTENDED_VARIANTS` ``extended`` and :data:`LONG_TESTS` ``long`` before
    ``-m`` selects."""
    for item in items:
        if item.nodeid in EXTENDED_VARIANTS:
            item.add_marker(pytest.mark.extended)
        elif item.nodeid in LONG_TESTS:
            item.add_marker(pytest.mark.long)
