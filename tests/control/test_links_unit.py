"""Which rank cannot be reached: the judge on crafted evidence, and the probe itself."""

from __future__ import annotations

from planaria.control.links import find_unreachable
from planaria.wire.probes import LinkReport, ProbeServer, probe


def test_a_rank_no_one_reaches_is_cut_off():
    names = ["w0", "w1", "w2"]
    reports = {
        "w0": LinkReport(reached={"w1": True, "w2": False}),
        "w1": LinkReport(reached={"w0": True, "w2": False}),
    }  # w2 did not answer the controller's question either
    verdict = find_unreachable(names, {"w0": True, "w1": True, "w2": False}, reports)
    assert verdict.culprits == ("w2",)


def test_two_ranks_that_cannot_reach_each_other_are_told_apart_by_the_controller():
    reports = {"w0": LinkReport(reached={"w1": False}), "w1": LinkReport(reached={"w0": False})}
    verdict = find_unreachable(["w0", "w1"], {"w0": True, "w1": False}, reports)
    assert verdict.culprits == ("w1",)


def test_the_common_end_of_every_stalled_flow_is_the_culprit():
    """Every probe passes (only established flows are dropped); w2's flows to both peers
    hold unacked bytes."""
    ok = {"w0": True, "w1": True, "w2": True}
    reports = {
        "w0": LinkReport(reached={"w1": True, "w2": True}, endpoints=("10.0.0.1:4000",)),
        "w1": LinkReport(reached={"w0": True, "w2": True}, endpoints=("10.0.0.1:5000",)),
        "w2": LinkReport(reached={"w0": True, "w1": True},
                         stalled=(("10.0.0.1:6000", "10.0.0.1:4000"),
                                  ("10.0.0.1:6001", "10.0.0.1:5000")),
                         endpoints=("10.0.0.1:6000", "10.0.0.1:6001")),
    }
    assert find_unreachable(["w0", "w1", "w2"], ok, reports).culprits == ("w2",)


def test_one_stalled_flow_between_two_ranks_blames_no_one():
    reports = {
        "w0": LinkReport(reached={"w1": True}, stalled=(("a:1", "b:2"),), endpoints=("a:1",)),
        "w1": LinkReport(reached={"w0": True}, stalled=(("b:2", "a:1"),), endpoints=("b:2",)),
    }
    verdict = find_unreachable(["w0", "w1"], {"w0": True, "w1": True}, reports)
    assert verdict.culprits == ()


def test_a_probe_server_answers_and_a_closed_one_does_not():
    server = ProbeServer("127.0.0.1")
    assert probe(server.address, 2.0)
    server.close()
    assert not probe(server.address, 0.5)
