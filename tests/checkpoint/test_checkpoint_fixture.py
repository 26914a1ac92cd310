"""Checkpoints written by an earlier planaria restore in this one: ``tests/fixtures/checkpoint_v1``
holds the committed saves of a small job (``tests/fixtures/make_checkpoint_fixture.py``), and a
job resumes from them at another width, computing the training a job without the stop
computes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import planaria
from planaria.examples import mlp
from tests.assertions import assert_same_state, events, of

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v1"
N, SAVED, STEPS = 256, 4, 7  # the fixture's job: n=256, saved at steps 2 and 4


def test_a_checkpoint_of_an_earlier_version_resumes_at_another_width(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, root)  # the restore writes its lease: never into the fixture
    result = planaria.fit(mlp.make_spec(n=N), steps=STEPS, replicas=3, run_dir=tmp_path / "run",
                          checkpoint=planaria.CheckpointConfig(root=str(root), every=100,
                                                               fsync=False))
    evs = events(tmp_path / "run")
    assert [r["step"] for r in of(evs, "restore")] == [SAVED]
    assert [e["step"] for e in of(evs, "step_committed")] == list(range(SAVED, STEPS))
    # The width changes nothing: the same checkpoint resumed on one replica.
    root_1 = tmp_path / "ckpt_1"
    shutil.copytree(FIXTURE, root_1)
    at_width_1 = planaria.fit(mlp.make_spec(n=N), steps=STEPS, replicas=1,
                              run_dir=tmp_path / "run_1",
                              checkpoint=planaria.CheckpointConfig(root=str(root_1), every=100,
                                                                   fsync=False))
    assert_same_state(at_width_1.state_dict, result.state_dict)
    # And the job without the stop computes the same training. The fixture's steps ran on
    # the machine that wrote it: another CPU's kernels round differently (3e-5 after 4 steps,
    # measured between an AMD and an Intel machine), so this comparison allows that much;
    # a step lost or done twice moves a weight by 9e-3, 45 times the tolerance.
    reference = planaria.fit(mlp.make_spec(n=N), steps=STEPS, replicas=1,
                             run_dir=tmp_path / "ref")
    assert_same_state(reference.state_dict, result.state_dict, atol=2e-4, rtol=1e-3)
