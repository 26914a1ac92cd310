"""Node failures on a multi-node Ray cluster (head + worker nodes on this machine).

The controller runs on the head node, which has no CPUs for workers: every
worker is on another node and reaches the store over the network. A node is
removed the way a machine dies (its raylet and the job's workers on it killed
with SIGKILL at once, no notice); the final parameters must equal a
fault-free run's and every sample must be used exactly once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

import planaria
from planaria import Job, RunConfig, fit
from planaria.examples import mlp
from planaria.fit import _finish as finish
from tests.assertions import assert_exactly_once, assert_same_state, events, of
from tests.conftest import start_local_ray

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.cluster, pytest.mark.multiprocess, pytest.mark.slow]

N, G, STEPS = 512, 64, 24
LOSE_AT = 6  # the node dies before this step
# A dead node is marked dead in ~3 s instead of 12-15 s (Ray's defaults); see the README.
NODE_DEATH = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    was_up = ray.is_initialized()
    ray.shutdown()  # the session's local Ray, if an earlier module started it
    # A Cluster writes its address where a plain ray.init() on this machine looks for a
    # running cluster (TMP/ray/ray_current_cluster): keep it in a directory of its own, so
    # that no other Ray started meanwhile (or after a crash) joins this one. Short: Ray's
    # socket paths live under it.
    temp_dir = tempfile.mkdtemp(prefix="planaria-", dir="/tmp")
    before = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_ADDRESS")}
    os.environ["RAY_TMPDIR"] = temp_dir
    c = None
    try:
        c = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0, "include_dashboard": False, "_system_config": NODE_DEATH,
            },
        )
        # Joined without an address, as a user's ray.init() finds a cluster: the jobs get
        # RunConfig(address=None) and must still see that they run on a cluster.
        os.environ["RAY_ADDRESS"] = c.address
        ray.init(configure_logging=False, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(temp_dir, ignore_errors=True)
        if was_up:
            start_local_ray()


@pytest.fixture
def nodes(cluster: Cluster) -> Iterator[Any]:
    """Adds worker nodes to the cluster; removes those left at the end of the test."""

    def add(num_cpus: int) -> Any:
        node = cluster.add_node(num_cpus=num_cpus)
        cluster.wait_for_nodes()
        return node

    yield add
    for node in list(cluster.worker_nodes):
        cluster.remove_node(node)


@pytest.fixture(scope="module")
def reference(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict:
    node = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        return fit(
            mlp.make_spec(n=N), steps=STEPS, replicas=2, run_dir=tmp_path_factory.mktemp("ref")
        ).state_dict
    finally:
        cluster.remove_node(node)


def node_of(job: Job, name: str) -> str:
    handle = next(h for h in job.members if h.name == name)
    return str(ray.get(handle.actor.__ray_call__.remote(
        lambda self: ray.get_runtime_context().get_node_id()), timeout=30))


def kill_node(cluster: Cluster, job: Job, node: Any) -> set[str]:
    """Kills ``node`` as a machine dies: its raylet and the job's workers on it at once (on
    their own, the workers of a node removed here would outlive their raylet by seconds,
    answering calls and training on while millisecond steps finish the run). Returns the
    names of the workers lost."""
    lost = {n for n in job.names if node_of(job, n) == node.node_id}
    pids = ray.get([h.actor.__ray_call__.remote(lambda self: os.getpid())
                    for h in job.members if h.name in lost], timeout=30)
    cluster.remove_node(node, allow_graceful=False)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return lost


def crowded_node(job: Job, nodes: list[Any]) -> Any:
    """The node that runs the most of the job's workers."""
    where = [node_of(job, name) for name in job.names]
    return max(nodes, key=lambda n: where.count(n.node_id))


def train(job: Job, at: dict[int, Any], after_fault: Any = None) -> planaria.FitResult:
    """fit()'s loop; ``at[s]()`` runs before step s, ``after_fault()`` once the first fault
    is recovered from. Waits (bounded) for the full width before the last steps, so that
    slow starts on this machine cannot end the run first."""
    while job.steps_done < STEPS:
        try:
            if job.steps_done in at:
                at.pop(job.steps_done)()
            if job.steps_done == STEPS - 3:
                job.wait_for_width(job.config.replicas, timeout_s=120)
            job.train_step()
        except planaria.Failure as failure:
            job.recovery.handle(failure)
            if after_fault is not None:
                after_fault()
                after_fault = None
    run_dir = job.run_dir
    state = finish(job)  # as fit() reads the final state
    return planaria.FitResult(job.steps_done, job.losses, run_dir / "events.jsonl", state, run_dir)


def check(run_dir: Path, result: planaria.FitResult, reference: dict, lost: set[str]) -> list[dict]:
    assert result.final_step == STEPS
    assert_same_state(reference, result.state_dict)
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run_dir)
    faults = of(evs, "fault")
    # The node's workers, and only they, are lost in one step: as one fault, or as two when
    # one's death is noticed a moment after the other's.
    assert {f["kind"] for f in faults} == {"worker_lost"}
    assert len({f["step"] for f in faults}) == 1
    assert {w for f in faults for w in f["worker"].split(",")} == lost
    assert all(r["lost_steps"] == 0 for r in of(evs, "recovered"))
    # The survivors went on (resize); whether a step commits at width 2 before the
    # replacements join depends on when the dead node's processes exit (seconds after their
    # raylet, while millisecond steps run on), so it is not asserted.
    assert [a["action"] for a in of(evs, "action")][:1] == ["resize"]
    assert of(evs, "step_committed")[-1]["width"] == 4
    return evs


def test_node_lost_then_a_new_node_takes_the_replacements(tmp_path, cluster, nodes, reference):
    a, b = nodes(2), nodes(2)  # two workers on each: no room left for replacements
    spec = mlp.make_spec(n=N)
    config = RunConfig(steps=STEPS, replicas=4, run_dir=tmp_path, ledger=True, placement="spread")
    lost: dict[str, Any] = {}

    def lose_a_node() -> None:
        lost["node"] = crowded_node(job, [a, b])
        lost["t"] = time.time()
        lost["workers"] = kill_node(cluster, job, lost["node"])

    def add_a_node() -> None:  # once the job goes on with the survivors
        assert job.width < 4
        lost["new"] = nodes(2)

    with Job(spec, config) as job:
        assert job.config.address is None
        assert job.store_host == ray.util.get_node_ip_address()  # not 127.0.0.1 here
        result = train(job, {LOSE_AT: lose_a_node}, after_fault=add_a_node)
        new_node = lost["new"].node_id
        joined = [h.name for h in job.members if h.name not in {"w0", "w1", "w2", "w3"}]
        assert len(joined) == 2 and {node_of(job, n) for n in joined} == {new_node}
    evs = check(tmp_path, result, reference, lost["workers"])
    assert len(lost["workers"]) == 2
    fault = of(evs, "fault")[0]
    assert fault["t"] - lost["t"] < 10
    started = {e["worker"]: e["t"] for e in of(evs, "worker_started")}
    assert all(started[n] > lost["t"] for n in joined)


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface with ``address``, if any."""
    from planaria.wire.interfaces import interface_address

    for _, name in socket.if_nameindex():
        try:
            if interface_address(name) == address:
                return name
        except planaria.ConfigError:
            continue
    return None


@pytest.mark.extended
def test_node_lost_replacements_on_the_node_left(tmp_path, cluster, nodes, reference):
    a, b = nodes(4), nodes(4)  # two workers on each, room for two more on each
    node_ip = ray.util.get_node_ip_address()
    iface = interface_of(node_ip)
    config = RunConfig(
        steps=STEPS, replicas=4, run_dir=tmp_path, ledger=True, placement="spread",
        network_interface=iface,
    )
    lost: dict[str, Any] = {}

    def lose_a_node() -> None:
        lost["node"] = crowded_node(job, [a, b])
        lost["workers"] = kill_node(cluster, job, lost["node"])

    with Job(mlp.make_spec(n=N), config) as job:
        # The store listens on the node's address only, and every worker (none is on the
        # head node) reached it from its own node.
        assert job.store_host == node_ip
        if node_ip != "127.0.0.1":
            with pytest.raises(ConnectionRefusedError), socket.socket() as s:
                s.connect(("127.0.0.1", job.store.port))
        if iface is not None:
            envs = ray.get([h.actor.__ray_call__.remote(
                lambda self: os.environ.get("GLOO_SOCKET_IFNAME")) for h in job.members])
            assert envs == [iface] * 4
        head = ray.get_runtime_context().get_node_id()
        assert head not in {node_of(job, n) for n in job.names}
        result = train(job, {LOSE_AT: lose_a_node})
        left = ({a, b} - {lost["node"]}).pop()
        assert {node_of(job, n) for n in job.names} == {left.node_id}
    check(tmp_path, result, reference, lost["workers"])
    assert len(lost["workers"]) == 2
