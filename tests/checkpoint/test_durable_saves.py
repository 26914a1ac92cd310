"""Written is durable: a save commits when its last writer finishes, and is never thrown away.

A save used to commit only at a later step boundary (in a job's autonomous runs, the next
checkpoint boundary): a controller or replica killed between its writers finishing and
that boundary lost it. Now the last writer's answer starts the commit; each shard's record
lies beside it, so a save whose writers finished commits even when the controller dies
before it could (the next controller of the root commits it); a drained writer leaves
after its shard is in; ``close()`` finishes the save in flight.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import fsspec
import pytest
import ray
import torch

import planaria
from planaria import Job, RunConfig
from planaria.checkpoint import AsyncShardWriter, plan_shards
from planaria.checkpoint.config import CheckpointConfig
from planaria.checkpoint.finished import commit_finished_saves
from planaria.checkpoint.restore import list_checkpoints
from planaria.checkpoint.storage import Storage
from planaria.checkpoint.writer import SAVE_FILE, shard_dir
from planaria.examples import mlp
from tests.assertions import assert_exactly_once, assert_same_state, events, of
from tests.assertions import run_to as drive
from tests.control.test_long_steps import SlowLoss

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

REPO = Path(__file__).resolve().parents[2]
N, G, MBS = 256, 48, 8




def spec(micro_s: float = 0.0, *, gated: bool = False) -> planaria.TrainSpec:
    base = mlp.make_spec(n=N, global_batch_size=G, micro_batch_size=MBS)
    data = base.dataset
    if gated:  # the dataset factory runs in every worker first: gated:// is known there
        def data():
            register_gated()
            return base.dataset()
    return planaria.TrainSpec(
        model=base.model, optimizer=base.optimizer,
        loss=SlowLoss(micro_s) if micro_s else base.loss, dataset=data,
        global_batch_size=G, micro_batch_size=MBS, grad_clip_norm=base.grad_clip_norm,
        seed=0, name="mlp",
    )




# ---- a file system whose writes wait at a gate --------------------------------------------


def register_gated() -> None:
    """Registers ``gated://``: local files seen as an object store (planaria's faulty://
    without faults), where opening a ``.safetensors`` file for writing waits until the file
    ``open`` exists in the ``gate`` storage option's directory. (The class is made here,
    where it is used: a worker builds its own rather than unpickle one.)"""
    from planaria.faults.campaign.storage_faults import FaultyFileSystem

    class GatedFileSystem(FaultyFileSystem):
        protocol = "gated"

        def __init__(self, control: str, gate: str | None = None, **kwargs) -> None:
            super().__init__(control, **kwargs)
            self.gate = gate

        @classmethod
        def _strip_protocol(cls, path):
            path = str(path)
            path = path[len("gated://"):] if path.startswith("gated://") else path
            return path.rstrip("/") or "/"

        def _open(self, path, mode="rb", **kwargs):
            if self.gate and "w" in mode and str(path).endswith(".safetensors"):
                while not os.path.exists(os.path.join(self.gate, "open")):
                    time.sleep(0.01)
            return super()._open(path, mode=mode, **kwargs)

    fsspec.register_implementation("gated", GatedFileSystem, clobber=True)


def gated_options(tmp_path: Path, gate: Path) -> dict:
    control = tmp_path / "control"
    control.mkdir(exist_ok=True)
    return {"control": str(control), "gate": str(gate)}


# ---- the tests ------------------------------------------------------------------------------


def test_finished_saves_are_committed_from_their_records_alone(tmp_path):
    """No processes: two writers finish a save, nobody commits it; the next controller of
    the root does, and leaves a save missing a record and another run's save alone."""
    root = str(tmp_path / "ckpt")
    tensors = {"model/w": torch.arange(12.0).reshape(3, 4), "model/b": torch.ones(5)}
    specs = {k: (t.shape, t.dtype) for k, t in tensors.items()}

    def save(step: int, save_id: str, run_id: str, writers: int) -> None:
        plans = plan_shards(specs, 2)
        for i in range(writers):
            w = AsyncShardWriter(root, fsync=False, verify=True)
            w.start(step, tensors, plans[i], save_id=save_id)
            w.result(30)
        st = Storage(root)
        desc = {"step": step, "save_id": save_id, "shards": 2, "run_id": run_id,
                "meta": {"steps_done": step}}
        Path(shard_dir(st, step, save_id), SAVE_FILE).write_text(json.dumps(desc))

    save(5, "aaaa", "run-a", writers=2)  # whole: committed
    save(7, "bbbb", "run-a", writers=1)  # a writer did not finish: left
    save(9, "cccc", "run-other", writers=2)  # not this lineage's: left
    assert commit_finished_saves(root, run_ids={"run-a"}) == [5]
    committed = [c.step for c in list_checkpoints(root) if c.committed]
    assert committed == [5]


@pytest.mark.multiprocess
@pytest.mark.usefixtures("ray_cluster")
def test_a_save_commits_when_its_last_writer_finishes_not_at_the_next_boundary(tmp_path):
    # Steps of ~0.1 s, a save every 10 steps: each save used to commit at the next save's
    # boundary, ~1 s after it began.
    job = Job(spec(micro_s=0.05), RunConfig(steps=31, replicas=2, run_dir=tmp_path),
              checkpoint=CheckpointConfig(every=10, fsync=False))
    with job:
        drive(job, 31)
    saved = [e for e in of(events(tmp_path), "checkpoint_saved") if e["reason"] == "interval"]
    assert [e["step"] for e in saved] == [10, 20, 30]
    for e in saved:
        assert e["save_s"] < 0.5, e  # not the interval (~1 s)
        assert e["t"] - e["writers_done_t"] < 0.2, e


@pytest.mark.multiprocess
@pytest.mark.usefixtures("ray_cluster")
def test_every_replica_killed_after_a_save_began_restores_that_save(tmp_path):
    ref_dir = tmp_path / "ref"
    with Job(spec(), RunConfig(steps=20, replicas=3, run_dir=ref_dir)) as ref_job:
        ref = drive(ref_job, 20)
    run = tmp_path / "run"
    job = Job(spec(micro_s=0.03), RunConfig(steps=20, replicas=3, run_dir=run, ledger=True),
              checkpoint=CheckpointConfig(every=10, fsync=False),
              chaos=planaria.ChaosPlan.parse("kill:w0@step15,kill:w1@step15,kill:w2@step15"))
    with job:
        state = drive(job, 20)
    assert_same_state(ref, state)
    assert_exactly_once(run, num_samples=N, global_batch_size=G, steps=20)
    restore = of(events(run), "restore")[0]
    assert restore["step"] == 10 and restore["lost_steps"] == 5


@pytest.mark.multiprocess
@pytest.mark.usefixtures("ray_cluster")
def test_a_preemption_during_a_save_keeps_the_leavers_shard(tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    register_gated()
    root = f"gated://{tmp_path / 'ckpt'}"
    job = Job(spec(micro_s=0.02, gated=True),
              RunConfig(steps=12, replicas=3, run_dir=tmp_path / "run"),
              checkpoint=CheckpointConfig(every=6, fsync=False, root=root,
                                          storage_options=gated_options(tmp_path, gate)))
    noticed = threading.Event()

    def preempt_while_writing(job: Job, phase: str, **info) -> None:
        if phase == "save" and job.steps_done == 6:  # the writers wait at the gate now
            os.kill(next(h.pid for h in job.members if h.name == "w1"), signal.SIGTERM)

    def open_gate_on_notice(record: dict) -> None:
        if record["event"] == "preempt_notice":  # the drain follows: the shard is let through
            (gate / "open").write_text("1")
            noticed.set()

    job.hooks.append(preempt_while_writing)
    job.log.add_listener(open_gate_on_notice)
    with job:
        drive(job, 12)
    assert noticed.is_set()
    evs = events(tmp_path / "run")
    assert not of(evs, "checkpoint_failed"), of(evs, "checkpoint_failed")
    six = next(e for e in of(evs, "checkpoint_saved") if e["step"] == 6)
    assert six["writers"] == 3
    drained = of(evs, "drained")[0]
    assert drained["worker"] == "w1" and drained["t"] >= six["writers_done_t"] - 0.5


@pytest.mark.multiprocess
@pytest.mark.usefixtures("ray_cluster")
def test_close_finishes_the_save_in_flight(tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    register_gated()
    root = f"gated://{tmp_path / 'ckpt'}"
    job = Job(spec(gated=True), RunConfig(steps=4, replicas=2, run_dir=tmp_path / "run"),
              checkpoint=CheckpointConfig(every=2, fsync=False, root=root,
                                          storage_options=gated_options(tmp_path, gate)))
    with job:
        (gate / "open").write_text("1")
        drive(job, 3)
        (gate / "open").unlink()
        drive(job, 4)
        job.boundary()  # the save of step 4 starts, held at the gate ...
        assert job.checkpointer.inflight_step is not None
        threading.Timer(1.0, lambda: (gate / "open").write_text("1")).start()
    # ... and close() waited for it rather than abandoning it.
    evs = events(tmp_path / "run")
    assert [e["step"] for e in of(evs, "checkpoint_saved")][-1] == 4
    assert not of(evs, "checkpoint_failed")


# ---- a controller killed ----------------------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    sys.path[:0] = [{repo!r}, {src!r}]
    import planaria
    from planaria import Job, RunConfig
    from planaria.checkpoint.config import CheckpointConfig
    from tests.checkpoint.test_durable_saves import spec, drive

    cfg = json.loads(sys.argv[1])
    job = Job(spec(cfg["micro_s"]), RunConfig(steps=cfg["steps"], replicas=2,
              run_dir=cfg["run_dir"], ledger=True),
              checkpoint=CheckpointConfig(every=cfg["every"], fsync=False))

    def die(job, phase, **info):
        kill = cfg.get("kill")
        if kill is None:
            return
        if kill["phase"] == "boundary" and phase == "boundary" and job.steps_done == kill["at"]:
            os.kill(os.getpid(), signal.SIGKILL)
        if kill["phase"] == "written" and phase == "save" and job.steps_done == kill["at"]:
            # The writers are told; wait until every shard's record lies beside it, then die
            # before the commit could start.
            while len([p for p in os.popen("find " + cfg["ckpt"] + " -name '*.record.json'")
                       .read().split() if ".tmp-" in p]) < 2:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)

    job.hooks.append(die)
    with job:
        drive(job, cfg["steps"])
        sd = job.model_state_dict()
    from safetensors.torch import save_file
    final = os.path.join(cfg["run_dir"], "final.safetensors")
    save_file({{k: v.contiguous() for k, v in sd.items()}}, final)
""")


def run_controller(tmp_path: Path, cfg: dict) -> int:
    script = tmp_path / "controller.py"
    script.write_text(SCRIPT.format(repo=str(REPO), src=str(REPO / "src")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "src")])}
    log = tmp_path / f"controller-{time.time_ns()}.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, str(script), json.dumps(cfg)], env=env,
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=err)
    try:
        return proc.wait(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for e in of(events(cfg["run_dir"]), "worker_started"):  # what a killed job leaves
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(e["pid"], signal.SIGKILL)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("when", ["written",
                                  pytest.param("steps_after", marks=pytest.mark.extended)])
def test_a_controller_killed_after_a_save_was_written_restores_that_save(tmp_path, when):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    kill = ({"phase": "written", "at": 10} if when == "written"
            else {"phase": "boundary", "at": 14})  # 4 steps after the save of step 10 began
    cfg = {"run_dir": str(run_dir), "steps": 20, "every": 10, "micro_s": 0.02,
           "ckpt": str(ckpt), "kill": kill}
    assert run_controller(tmp_path, cfg) == -signal.SIGKILL
    assert run_controller(tmp_path, {**cfg, "kill": None}) == 0
    evs = events(run_dir)
    restore = next(e for e in of(evs, "restore") if e.get("reason") == "resume")
    assert restore["step"] == 10
    if when == "written":
        assert [e["step"] for e in of(evs, "checkpoint_adopted")] == [10]
    from safetensors.torch import load_file

    with Job(spec(), RunConfig(steps=20, replicas=2, run_dir=tmp_path / "ref")) as ref_job:
        ref = drive(ref_job, 20)
    assert_same_state(ref, load_file(str(run_dir / "final.safetensors")))
    assert_exactly_once(run_dir, num_samples=N, global_batch_size=G, steps=20)
