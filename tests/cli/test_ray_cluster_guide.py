"""The Ray cluster and Slurm guides' commands (docs/guide/ray-cluster.md, docs/guide/slurm.md),
as far as one machine allows.

A head (``ray start --head``) and a worker node (``ray start --address``) on loopback, with
token authentication on; ``planaria run --address --runtime-env`` of a tiny job whose
workers must run on the worker node (the head offers no CPU) and import a module of the
user's project that only the runtime_env carries there; the same from Python; a driver
with the wrong token refused.
The nodes run with ``--block`` and are stopped by ending those processes: ``ray stop``
would stop every Ray on the machine, other jobs' included. The sbatch template is checked by
``bash -n`` and shellcheck, and run for real where a Slurm cluster answers (one node here).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SBATCH = Path(__file__).resolve().parents[2] / "src/planaria/examples/slurm/planaria.sbatch"

HELPER = """\
import torch


def make_dataset():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(256, 8, generator=g),
                                          torch.randn(256, 1, generator=g))
"""

TRAIN = """\
import torch

import planaria
from helper import make_dataset  # a module of the project: it travels in the runtime_env

spec = planaria.TrainSpec(
    model=lambda: torch.nn.Linear(8, 1),
    optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    loss=lambda model, batch: torch.nn.functional.mse_loss(model(batch[0]), batch[1]),
    dataset=make_dataset, global_batch_size=16, micro_batch_size=8, seed=0)
"""

SELF_CONTAINED = """\
import torch

import planaria

spec = planaria.TrainSpec(
    model=lambda: torch.nn.Linear(8, 1),
    optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    loss=lambda model, batch: torch.nn.functional.mse_loss(model(batch[0]), batch[1]),
    dataset=lambda: torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1)),
    global_batch_size=16, micro_batch_size=8, seed=0)
"""

DRIVER = """\
import sys

import planaria

sys.path.insert(0, sys.argv[2])  # the project, importable here; the workers get it by runtime_env
from train import spec

result = planaria.fit(spec, steps=6, replicas=2, run_dir=sys.argv[3], address=sys.argv[1],
                      ray_init_kwargs={"runtime_env": {"working_dir": sys.argv[2]}})
print("final step", result.final_step)
"""

READY = "block forever"  # what `ray start --block` prints once the node is up


@dataclass(frozen=True, kw_only=True)
class Cluster:
    address: str
    env: dict[str, str]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_node(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    node = subprocess.Popen(["ray", "start", "--block", "--disable-usage-stats", *args],
                            env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while READY not in log.read_text(errors="replace"):
        if node.poll() is not None or time.monotonic() > deadline:
            _stop(node)
            pytest.fail(f"ray start {' '.join(args)} did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return node


def _stop(node: subprocess.Popen[bytes]) -> None:
    if node.poll() is None:
        node.send_signal(signal.SIGTERM)  # `ray start --block` stops the node's processes
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if subprocess.run(["ray", "--version"], capture_output=True).returncode != 0:
        pytest.skip("the `ray` command is not on PATH")
    logs = tmp_path_factory.mktemp("ray-nodes")
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's sockets: paths under 108 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # The guide's token: one secret, the same on every node and in the driver.
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               RAY_USAGE_STATS_ENABLED="0")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    head = _start_node(["--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                        "--num-cpus", "0", "--include-dashboard", "false",
                        "--temp-dir", temp_dir], env, logs / "head.log")
    try:
        worker = _start_node(["--address", address, "--node-ip-address", "127.0.0.1",
                              "--num-cpus", "4"], env, logs / "worker.log")
        try:
            yield Cluster(address=address, env=env)
        finally:
            _stop(worker)
    finally:
        _stop(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _project(tmp_path: Path) -> Path:
    """A user's project: the script and a module of its own that the workers must import."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "helper.py").write_text(HELPER)
    (project / "train.py").write_text(TRAIN)
    return project


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.cluster
def test_planaria_run_with_address_and_a_runtime_env_trains_on_the_worker_node(cluster, tmp_path):
    project = _project(tmp_path)
    done = subprocess.run(
        ["planaria", "run", "train.py", "--address", cluster.address, "--replicas", "2",
         "--steps", "6", "--run-dir", str(tmp_path / "run"), "--checkpoint-every", "none",
         "--runtime-env", '{"working_dir": "."}'],
        cwd=project, env=cluster.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "done: 6 steps" in done.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.cluster
def test_fit_with_a_runtime_env_carries_the_project_to_the_workers(cluster, tmp_path):
    project = _project(tmp_path)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    done = subprocess.run(
        [sys.executable, str(driver), cluster.address, str(project), str(tmp_path / "run")],
        env=cluster.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "final step 6" in done.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.cluster
def test_a_driver_without_the_token_is_refused(cluster, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SELF_CONTAINED)
    done = subprocess.run(
        ["planaria", "run", str(script), "--address", cluster.address, "--replicas", "1",
         "--steps", "2", "--run-dir", str(tmp_path / "run"), "--checkpoint-every", "none"],
        env={**cluster.env, "RAY_AUTH_TOKEN": "not-the-token"},
        capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "InvalidAuthToken" in done.stdout + done.stderr


def test_the_sbatch_template_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    if shutil.which("shellcheck") is not None:
        done = subprocess.run(["shellcheck", str(SBATCH)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout


def _slurm_has_an_idle_node() -> bool:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    done = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    return done.returncode == 0 and "idle" in done.stdout.split()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(not _slurm_has_an_idle_node(), reason="no Slurm cluster with an idle node")
def test_the_sbatch_template_runs_planaria_on_slurm(tmp_path):
    (tmp_path / "train.py").write_text(SELF_CONTAINED)
    settings = {"SCRIPT": "train.py", "STEPS": "6", "WORKERS_PER_NODE": "2",
                "RAY_PORT": str(_free_port()), "RUN_DIR": str(tmp_path / "run"),
                "CHECKPOINT_ROOT": str(tmp_path / "checkpoints")}
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        ["sbatch", "--wait", "--nodes=1", "--cpus-per-task=2", f"--chdir={tmp_path}",
         f"--output={tmp_path}/slurm-%j.log",
         "--export=ALL," + ",".join(f"{k}={v}" for k, v in settings.items()), str(SBATCH)],
        env=env, capture_output=True, text=True, timeout=600)
    (log,) = tmp_path.glob("slurm-*.log")
    output = log.read_text(errors="replace")
    assert done.returncode == 0, output[-4000:]
    assert "done: 6 steps" in output
