"""A dead process-group link is found, though the process and its heartbeat live.

The victim's gloo connections are black-holed with netfilter (its TCP flows to its peers
dropped both ways, its store connections left alone), in the middle of a step, before the
gradient's all-reduce: every rank then waits on its peers, none stuck in its own work,
and only the collective timeout (minutes) would end it. The controller finds the rank
whose traffic is lost (planaria.control.links) within the step deadline plus a few seconds and
evicts it, and no one else; with two ranks, where the evidence cannot tell the ends of a
dropped flow apart, no one is blamed and the generation is built again on fresh links.
Either way the training equals a fault-free run's and every sample is used once.

Needs root and iptables (Debian's ``iptables``, installed by ``.ci/run``); skips otherwise.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import ray

from planaria import HangConfig, Job, RunConfig
from tests.assertions import assert_exactly_once, assert_same_state, events, of
from tests.checkpoint.test_durable_saves import G, N, drive, spec
from tests.loop_faults import install

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS = 8
CHAIN = f"PLANARIA-LINK-{os.getpid()}"


@pytest.fixture
def netfilter():
    from planaria.faults.campaign.netfilter import Chain, available

    if not available():
        pytest.skip("needs root and iptables (apt-get install iptables) to drop a link")
    chain = Chain(CHAIN)
    if not chain.create():
        pytest.skip("iptables is not usable here (no netfilter in this kernel or sandbox)")
    try:
        yield chain.name
    finally:
        chain.remove()


class CutLinks:
    """At ``step``, once its gradient is computed (before the all-reduce): drops every TCP
    flow between this worker and the ``peers`` processes, both ways, in netfilter chain
    ``chain`` (planaria.faults.campaign.netfilter)."""

    def __init__(self, step: int, peers: list[int], chain: str, marker: str) -> None:
        self.step, self.peers, self.chain, self.marker = step, peers, chain, marker

    def __call__(self, worker, step: int, phase: str) -> None:
        if phase != "computed" or step != self.step or os.path.exists(self.marker):
            return
        from planaria.faults.campaign.netfilter import cut_links

        flows = cut_links(self.peers, self.chain)
        Path(self.marker).write_text(f"{time.time()} {flows}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with Job(spec(), RunConfig(steps=STEPS, replicas=3,
                               run_dir=tmp_path_factory.mktemp("ref"))) as job:
        return drive(job, STEPS)


HANG = HangConfig(floor_s=2.0)


@pytest.mark.parametrize("replicas", [pytest.param(3, marks=pytest.mark.extended), 2])
def test_a_black_holed_link_is_found_within_the_deadline(tmp_path, netfilter, reference,
                                                         replicas):
    run = tmp_path / "run"
    job = Job(spec(micro_s=0.05), RunConfig(steps=STEPS, replicas=replicas, run_dir=run,
                                            ledger=True),
              hang=HANG)
    marker = tmp_path / "cut"
    with job:
        victim = job.members[-1]
        peers = [h.pid for h in job.members if h is not victim]
        install(job, victim.name, CutLinks(3, peers, netfilter, str(marker)))
        state = drive(job, STEPS)
        job.wait_for_width(replicas, timeout_s=120)
    cut_t, flows = marker.read_text().split()
    assert int(flows) >= 1
    assert_same_state(reference, state)
    assert_exactly_once(run, num_samples=N, global_batch_size=G, steps=STEPS)
    evs = events(run)
    check = of(evs, "link_check")[0]
    deadline = HANG.floor_s  # the steps are far shorter than the floor
    if replicas >= 3:
        faults = of(evs, "fault")
        assert [(f["kind"], f["worker"]) for f in faults] == [("worker_unreachable",
                                                              victim.name)]
        assert check["culprits"] == [victim.name]
        found = of(evs, "detected")[0]["t"]
        assert found - float(cut_t) < deadline + 5.0
        assert of(evs, "detected")[0]["detect_s"] >= deadline  # dated from its own record
    else:  # two ends of one dropped flow: no one to blame; fresh links
        assert check["culprits"] == []
        assert not [f for f in of(evs, "fault") if f.get("worker")]
        rebuilt = next(g for g in of(evs, "generation") if g["t"] > float(cut_t))
        assert rebuilt["workers"] == of(evs, "generation")[0]["workers"]
        assert rebuilt["t"] - float(cut_t) < deadline + 5.0
