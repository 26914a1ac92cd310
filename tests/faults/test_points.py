"""The fault points: arming, running, disarming; every point the code hits is named."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import planaria
from planaria.faults import points
from planaria.faults.points import POINTS, WORKER_POINTS, FaultPoints


def test_an_armed_point_runs_its_action_with_the_context_and_returns_what_it_returns():
    reg = FaultPoints(WORKER_POINTS, worker="w0")
    assert reg.hit("worker.loaded", step=1) is None and not reg.armed  # nothing armed
    seen: list[tuple[str, int]] = []
    reg.arm("worker.loaded", lambda *, worker, step: seen.append((worker, step)) or points.SKIP)
    assert reg.hit("worker.loaded", step=3) is points.SKIP
    assert reg.hit("worker.computed", step=3) is None  # another point: nothing
    assert seen == [("w0", 3)]
    reg.disarm("worker.loaded")
    assert reg.hit("worker.loaded", step=4) is None and not reg.armed


def test_a_point_armed_for_some_times_disarms_itself():
    reg = FaultPoints()
    runs: list[int] = []
    reg.arm("membership.commit_all", lambda **_: runs.append(1), times=2)
    for _ in range(4):
        reg.hit("membership.commit_all")
    assert runs == [1, 1] and not reg.armed
    with pytest.raises(ValueError):
        reg.arm("membership.commit_all", print, times=0)


def test_an_unknown_point_is_a_clear_error():
    with pytest.raises(KeyError, match=r"no fault point 'membership\.comit_all'"):
        points.arm("membership.comit_all", print)
    with pytest.raises(KeyError, match=r"worker\.loaded"):
        FaultPoints(WORKER_POINTS).arm("recovery.admit", print)  # a controller point


def test_armed_holds_for_its_block_only():
    with points.armed("recovery.admit", lambda **info: sorted(info)):
        assert points.hit("recovery.admit", recovery=None, ready=[]) == ["ready", "recovery"]
    assert points.hit("recovery.admit", recovery=None, ready=[]) is None
    assert not points.controller.armed


def _hits(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "hit" and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            names.append(node.args[0].value)
    return names


def test_every_point_the_code_hits_is_named_and_every_named_point_is_hit():
    src = Path(planaria.__file__).parent
    hit = [n for f in sorted(src.rglob("*.py")) for n in _hits(ast.parse(f.read_text()))]
    assert set(hit) <= set(POINTS), set(hit) - set(POINTS)
    assert set(POINTS) <= set(hit), set(POINTS) - set(hit)

