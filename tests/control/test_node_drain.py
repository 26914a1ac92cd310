"""Planned departures announced from outside the worker, on a real multi-node Ray cluster on
this machine: a node Ray drains, and a node whose first process gets SIGTERM (a Kubernetes
pod being deleted) with ``planaria node-drain-hook`` wrapping its ``ray start``.

Each run's workers on the departing node leave at a step boundary (no failed step, no
fault of kind failure), the data is served exactly once, and the final parameters equal
a fault-free run's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.core.generated import autoscaler_pb2

from planaria import Job, RecoveryPolicy, RunConfig, fit
from planaria.examples import mlp
from tests.assertions import assert_exactly_once, assert_same_state, events, of

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.cluster]

N, G, STEPS = 512, 64, 20
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    """A head with no CPUs (the controller is this process) and a 2-CPU node; each test adds
    the 1-CPU node that departs. The session's local Ray (tests/conftest.py) is shut down
    for the while and started again after."""
    was_up = ray.is_initialized()
    ray.shutdown()
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    try:
        c.add_node(num_cpus=2)
        ray.init(address=c.address, log_to_driver=False, configure_logging=False)
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        if was_up:  # as tests/conftest.py's ray_cluster started it
            ray.init(num_cpus=8, include_dashboard=False, configure_logging=False,
                     log_to_driver=False)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    return fit(
        mlp.make_spec(n=N), steps=STEPS, replicas=1, run_dir=tmp_path_factory.mktemp("ref")
    ).state_dict


def _alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def _ends(node_id: str, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while _alive(node_id) and time.monotonic() < end:
        time.sleep(0.2)
    return not _alive(node_id)


def _wait_for_cpus(total: float, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while ray.cluster_resources().get("CPU", 0) < total:
        assert time.monotonic() < end, f"the cluster never reached {total} CPUs"
        time.sleep(0.2)


def _train(job: Job, *, notice_at: int, notice, until) -> dict:
    """Trains to STEPS; at step ``notice_at`` calls ``notice``, then waits a little between
    steps until ``until()`` (the departure was handled) so that a fast run cannot end first."""
    with job:
        while job.steps_done < STEPS:
            if job.steps_done == notice_at:
                notice(job)
            if job.steps_done > notice_at and not until():
                time.sleep(0.2)
            job.train_step()  # a planned departure never fails a step: no recovery here
        return job.model_state_dict()


def _check(run_dir: Path, state: dict, reference: dict, departed: set[str]) -> list[dict]:
    assert_same_state(reference, state)
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run_dir)
    assert not of(evs, "step_failed"), "a planned departure must not fail a step"
    assert [f["kind"] for f in of(evs, "fault")] == ["preempted"]
    assert {e["worker"] for e in of(evs, "drained")} == departed
    assert not of(evs, "restore"), "the state must never have left the job"
    return evs


@pytest.mark.extended
def test_workers_on_a_node_ray_drains_leave_at_a_step_boundary(cluster, reference, tmp_path):
    doomed = cluster.add_node(num_cpus=1)  # 2 + 1 CPUs for 3 replicas: one worker lands here
    _wait_for_cpus(3)
    run_dir = tmp_path / "run"
    job = Job(
        mlp.make_spec(n=N),
        RunConfig(steps=STEPS, replicas=3, spares=1, run_dir=run_dir, ledger=True,
                  drain_poll_s=0.5),
        policy=RecoveryPolicy(on_worker_lost="resize", min_replicas=1),
    )
    on_doomed: list[str] = []
    spares: list[str] = []
    nodes: list[str] = []

    def drain(job: Job) -> None:
        # The standby spare waits for a CPU: give it a node of its own, drained too.
        spare_node = cluster.add_node(num_cpus=1)
        assert job.wait_for_spares(timeout_s=90) == 1
        spares.extend(h.name for h in job.pool.standby)
        assert job.pool.standby[0].ray_node == spare_node.node_id
        on_doomed.extend(h.name for h in job.members if h.ray_node == doomed.node_id)
        gcs = ray._raylet.GcsClient(address=cluster.address)  # as `ray drain-node` does
        for node in (doomed, spare_node):
            nodes.append(node.node_id)
            accepted, why = gcs.drain_node(
                node.node_id,
                autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                "spot reclaim in 60 s",
                int((time.time() + 60) * 1000),
            )
            assert accepted, why

    state = _train(job, notice_at=5, notice=drain,
                   until=lambda: bool(of(events(run_dir), "drained")))
    assert len(on_doomed) == 1
    evs = _check(run_dir, state, reference, set(on_doomed))
    notice = of(evs, "preempt_notice")[0]
    assert notice["source"] == "node_drain" and notice["node"] == doomed.node_id
    assert notice["deadline_t"] == pytest.approx(time.time() + 60, abs=120)
    assert of(evs, "drained")[0]["step"] > 5
    lost = of(evs, "spare_lost")
    assert [(e["worker"], e["error"]) for e in lost] == [(spares[0], "its Ray node is draining")]
    # No replacement fits (the other node is full, the drained ones take none): width 2 on.
    assert of(evs, "step_committed")[-1]["width"] == 2
    for node in nodes:  # with their workers gone, Ray ends the drained nodes
        assert _ends(node), "Ray did not end a drained node (its workers left)"


@pytest.mark.extended
def test_a_sigterm_to_the_node_reaches_its_workers_through_the_hook(
    cluster, reference, tmp_path
):
    """A node as a KubeRay pod runs it: `planaria node-drain-hook -- ray start --block`
    (the pod's first process) -> raylet -> the worker processes. SIGTERM goes to the top."""
    markers = tmp_path / "markers"
    env = dict(os.environ, PLANARIA_WORKER_DIR=str(markers),
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="10")  # ray start's own drain on SIGTERM
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH")) if p
    )
    before = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    hook = subprocess.Popen(
        [sys.executable, "-m", "planaria.cli.main", "node-drain-hook", "--grace-s", "30", "--",
         sys.executable, "-m", "ray.scripts.scripts", "start", f"--address={cluster.address}",
         "--num-cpus=1", "--block", "--disable-usage-stats"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        _wait_for_cpus(3, timeout_s=60)
        (node_id,) = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - before
        run_dir = tmp_path / "run"
        job = Job(
            mlp.make_spec(n=N),
            # No polling of Ray here: the notice must come from the hook's SIGTERM.
            RunConfig(steps=STEPS, replicas=3, run_dir=run_dir, ledger=True, drain_poll_s=None),
            policy=RecoveryPolicy(on_worker_lost="resize", min_replicas=1),
        )
        on_node: list[str] = []

        def sigterm_the_node(job: Job) -> None:
            on_node.extend(h.name for h in job.members if h.ray_node == node_id)
            hook.send_signal(signal.SIGTERM)

        state = _train(job, notice_at=5, notice=sigterm_the_node,
                       until=lambda: bool(of(events(run_dir), "drained")))
        out, _ = hook.communicate(timeout=60)
    finally:
        if hook.poll() is None:
            hook.kill()
            hook.wait()
    assert len(on_node) == 1
    evs = _check(run_dir, state, reference, set(on_node))
    assert of(evs, "preempt_notice")[0]["source"] == "sigterm"
    assert "every planaria worker on this node has left" in out, out
    assert "marked draining" in out, out  # so no replacement was scheduled there meanwhile
    assert _ends(node_id), "the node's ray start did not end after its workers left"
