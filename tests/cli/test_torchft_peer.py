"""torchft as the benches run it: its gradient is the global batch's mean at any width,
its configuration reaches the lighthouse and the groups, and a warm standby joins when
told (bench/baselines/torchft_train.py, torchft_runners.py, torchft_standby.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from bench import common  # noqa: E402
from bench.baselines import torchft_runners  # noqa: E402
from bench.baselines.torchft_config import TorchftConfig  # noqa: E402
from bench.baselines.torchft_standby import Standby  # noqa: E402

STEPS = 4


def whole_batch_grads(size: str, steps: int) -> list[torch.Tensor]:
    """One process training the whole global batch: each step's flat gradient
    (sum of per-sample loss gradients ÷ global batch), the optimizer stepped after each."""
    model = common.make_model(size)
    optimizer = common.make_optimizer(model.parameters())
    dataset = common.make_dataset(size=size)
    out = []
    for step in range(steps):
        optimizer.zero_grad()
        ids = common.batch_ids(step)
        for chunk in common.micro_batches(ids, common.MICRO_BATCH):
            (common.loss_fn(model, common.load_batch(dataset, chunk)) / len(ids)).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        optimizer.step()
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("grads", ["bucket", "torchft-ddp"])
def test_two_groups_reduce_to_the_global_batch_mean(tmp_path, grads):
    pytest.importorskip("torchft")
    config = TorchftConfig(heartbeat_ms=1000, pg_timeout_s=10.0, async_quorum=True)
    run = torchft_runners.run_torchft_steady(
        STEPS, "tiny", 2, config=config, warmup=1, grads=grads, save_grads=True, timeout_s=200,
        workdir=tmp_path)
    expected = whole_batch_grads("tiny", STEPS)
    for path in run["grads"]:
        got = torch.load(path)
        assert len(got) == STEPS
        for step, (g, e) in enumerate(zip(got, expected, strict=True)):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    assert run["config"] == config.as_dict() and run["torchft_version"]


def test_bucket_grads_are_views_that_backward_adds_into():
    from bench.baselines.torchft_train import bucket_grads

    model = common.make_model("tiny")
    params = list(model.parameters())
    flat = bucket_grads(params)
    batch = common.load_batch(common.make_dataset(size="tiny"), [0, 1])
    common.loss_fn(model, batch).backward()
    assert flat.abs().sum() > 0
    assert torch.equal(flat, torch.cat([p.grad.reshape(-1) for p in params]))
    flat.zero_()
    assert all(p.grad.abs().sum() == 0 for p in params)


def test_the_config_reaches_the_lighthouse_and_the_groups():
    config = TorchftConfig(heartbeat_ms=100, quorum_tick_ms=20, pg_timeout_s=1.5,
                           async_quorum=False)
    try:
        lighthouse, script = torchft_runners.torchft_commands(config, 1234, 2, 500, ["--size=tiny"])
    except FileNotFoundError:
        pytest.skip("torchft_lighthouse is not installed")
    assert lighthouse[lighthouse.index("--heartbeat_timeout_ms") + 1] == "100"
    assert lighthouse[lighthouse.index("--quorum_tick_ms") + 1] == "20"
    assert "--pg-timeout-s=1.5" in script and "--async-quorum" not in script
    assert "--heartbeat-interval-ms=25" in script  # a quarter of a short timeout
    with pytest.raises(ValueError, match="pg_timeout_s is None"):
        torchft_runners.torchft_commands(TorchftConfig(), 1234, 2, 500, [])


def test_a_standby_joins_as_the_group_it_is_told_and_the_next_one_starts():
    started: list[subprocess.Popen] = []

    def start(n: int) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; print(repr(sys.stdin.readline()))"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=False)
        started.append(proc)
        return proc

    standby = Standby(start)
    first = standby.ready
    used = standby.take(2)
    assert used is first and standby.ready is not first and len(started) == 2
    assert printed(used) == b"'2\\n'"
    standby.close()
    assert printed(standby.ready) == b"''"  # released: no group


def printed(proc: subprocess.Popen) -> bytes:
    """What ``proc`` printed, once it has ended (its stdin already closed)."""
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.wait(timeout=30)
    return out.strip()


def test_the_sweep_descends_one_knob_at_a_time_and_stops_the_heartbeat_where_it_stops_improving():
    from bench.torchft_sweep import descend, most_runs

    start = TorchftConfig(heartbeat_ms=1000, pg_timeout_s=2.0)
    steps = [("heartbeat_ms", [1000, 500, 250, 100, 50]), ("quorum_tick_ms", [100, 50, 20]),
             ("warm_standby", [False, True])]
    asked: list[TorchftConfig] = []

    def score(c: TorchftConfig) -> float | None:
        asked.append(c)
        if c.quorum_tick_ms == 20:
            return None  # a run that failed never wins
        return {1000: 0.90, 500: 0.95, 250: 0.97, 100: 0.96, 50: 0.99}[c.heartbeat_ms] + (
            0.001 if c.quorum_tick_ms == 50 else 0) + (0.002 if c.warm_standby else 0)

    best, scores = descend(start, steps, score)
    assert best == TorchftConfig(heartbeat_ms=250, quorum_tick_ms=50, pg_timeout_s=2.0,
                                 warm_standby=True)
    assert 50 not in {c.heartbeat_ms for c in asked}  # 100 did not improve: stopped there
    assert len(asked) == len(set(asked)) == len(scores)  # each configuration run once
    assert most_runs(start, steps) == 1 + 4 + 2 + 1


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_nvrx_ft_launcher_trains_two_workers_on_cpu(tmp_path):
    """NVRx installs into its own environment (bench/baselines/PEERS.md): the test runs
    where this Python has it, and is skipped elsewhere."""
    pytest.importorskip("nvidia_resiliency_ext.fault_tolerance")
    from bench.baselines.nvrx_runner import run_nvrx_steady

    run = run_nvrx_steady(8, "tiny", 2, python=sys.executable, warmup=2, timeout_s=240,
                          workdir=tmp_path)
    assert len(run["step_ms"]) == 6 and run["step_ms_median"] > 0


def test_a_standby_that_died_before_it_was_needed_is_an_error_not_a_silent_replacement():
    def start(n: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"],
                                stdin=subprocess.PIPE)

    standby = Standby(start)
    standby.ready.wait(timeout=30)
    with pytest.raises(RuntimeError, match="exited with 3"):
        standby.take(0)
    standby.close()
