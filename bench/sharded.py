"""Sharded replicas: state per worker, step time against plain FSDP2 HSDP, and recovery.

    python bench/sharded.py              # tiny_gpt 128 x 2 layers, global 32 / micro 4, 3 rounds
    python bench/sharded.py --quick      # smoke run: a smaller model, few steps, 1 round

planaria's sharded replicas (``RunConfig(workers_per_replica=k)``: FSDP2 inside a
replica, planaria's elastic groups across replicas) on
``planaria.examples.tiny_gpt.make_spec(dim, layers, global_batch_size,
micro_batch_size)`` (a small decoder transformer, AdamW, a warm-up schedule, gradient
clipping at 1.0), 1 torch thread per worker. Every figure is measured in this run:

- ``state_bytes_per_worker`` (k = 1, 2, 4): a job of 1 replica x k workers trains
  2 steps, then the leader (``w0``) and, through it, each of its followers
  (``w0.1``, ...) report what they hold: the bytes of their local parameter shards
  (``planaria.worker.sharded.local`` of each DTensor), of their gradient shards (measured
  after the step's backward, before the reduction, by an action at the
  ``worker.computed`` fault point: FSDP2 keeps them sharded like the parameters) and of
  their optimizer state tensors (AdamW's moments and step counts). The figure is the
  largest worker's sum;
  ``state_ratio`` = that ÷ the k = 1 figure (targets: k = 2 ≤ 0.55, k = 4 ≤ 0.3;
  reported, not enforced).
- ``step_ms``: planaria at 2 replicas x 2 workers under the autonomous loop
  (``Job.run_steps``, ``fit``'s): the median period between successive
  ``step_committed`` records of RUN_DIR/events.jsonl (rank 0's commit times) over
  the steady steps (the first ``--warmup`` steps run apart and are left out).
  ``torchrun_hsdp_step_ms``: rank 0's median step time of
  ``baselines/hsdp_train.py`` (FSDP2 HSDP on a ``(2, 2)`` mesh, gloo, the same
  per-layer units, model, data, global batch and micro-batches per rank) under
  ``torchrun --nproc_per_node=4``, warm-up steps left out. The runs are interleaved
  (planaria, torchrun, planaria, ...; ``--rounds`` pairs) and the steady steps of all
  rounds pooled before taking medians; ``ratio`` = planaria ÷ torchrun (target
  ≤ 1.10). ``--loss-check`` adds one more HSDP run that all-reduces its loss (outside
  its timer) and compares every step's loss with planaria's first round.
- ``recover_s`` and ``back_at_full_width_s``: a 2 x 2 planaria job; worker ``w1.1``
  (a follower of replica ``w1``) SIGKILLs itself once it has computed step
  ``--fault-step`` (an action at its ``worker.computed`` fault point, armed through its
  leader); the driver loop is ``fit``'s (``run_steps``, ``recovery.handle`` on a
  ``planaria.Failure``) and goes on until the replacement replica has joined and a step
  committed at width
  2 (bounded by ``--join-wait-s``; ``wait_for_width`` once ``--after-steps`` steps
  past the fault were committed without the join). From the event log:
  ``recover_s`` = the ``recovered`` record's own ``recover_s`` (fault → first
  committed step), ``back_at_full_width_s`` = the ``fault`` record's ``fault_t`` →
  the first ``step_committed`` at width 2 from the step the replacement ``joined``
  on. The hook also notes the kill's own time, so the same two are given from the
  kill too (``from_kill``), with ``detect_s``, ``join_s`` and ``lost_steps``.

Each planaria job runs on a local Ray started for it (``address="local"``, 8
logical CPUs: a replica's followers are actors of one CPU each, and a replacement
replica starts while the survivors run) and stopped after it, so that no Ray runs
beside the torchrun rounds.

The last line printed is one JSON object (``"bench": "sharded"``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from bench import common  # noqa: E402
from bench.baselines.runners import run_hsdp_steady  # noqa: E402

STATE_KS = (1, 2, 4)
STATE_TARGETS = {"2": 0.55, "4": 0.3}
RATIO_TARGET = 1.10
REPLICAS, SHARDS = 2, 2  # the step-time and recovery runs
_ENDLESS = 10**9  # the recovery run's steps: the driver loop ends it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=128, help="tiny_gpt width")
    p.add_argument("--layers", type=int, default=2, help="tiny_gpt blocks")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=40, help="steps per step-time run (warm-up in)")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="planaria, torchrun pairs (interleaved)")
    p.add_argument("--state-steps", type=int, default=2, help="steps before the state is read")
    p.add_argument("--fault-step", type=int, default=10, help="w1.1 dies once it computed it")
    p.add_argument("--after-steps", type=int, default=10,
                   help="steps past the fault trained before waiting for the join")
    p.add_argument("--join-wait-s", type=float, default=300.0)
    p.add_argument("--loss-check", action="store_true",
                   help="one more HSDP run logging its global loss, compared with planaria's")
    p.add_argument("--no-state", action="store_true", help="skip the state measurement")
    p.add_argument("--no-recovery", action="store_true", help="skip the recovery run")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per torchrun run")
    p.add_argument("--workdir", default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: small model, few steps")
    args = p.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.steps, args.warmup, args.rounds = 32, 2, 8, 3, 1
        args.fault_step, args.after_steps = 3, 3
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.steps <= args.warmup + 1:
        p.error("--steps must exceed --warmup + 1")
    micro = args.global_batch // args.micro_batch
    if args.global_batch % args.micro_batch or micro < max(4, REPLICAS * SHARDS):
        p.error("the global batch must be at least 4 whole micro-batches")
    return args


def make_spec(args: argparse.Namespace) -> Any:
    from planaria.examples import tiny_gpt

    return tiny_gpt.make_spec(dim=args.dim, layers=args.layers,
                              global_batch_size=args.global_batch,
                              micro_batch_size=args.micro_batch)


def _ensure_worker_path() -> None:
    """Ray's workers inherit this environment: let them import ``bench`` (this module's
    hooks, when it is imported rather than run)."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(_REPO) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(_REPO), *parts])


@contextlib.contextmanager
def _ray() -> Iterator[None]:
    """A local Ray for one job (as bench/dispatch.py and the tests start theirs)."""
    import ray

    _ensure_worker_path()
    if __name__ != "__main__":
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    for attempt in range(3):
        try:
            ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1),
                     include_dashboard=False, log_to_driver=False, configure_logging=False)
            break
        except Exception as err:  # a node start timeout on a loaded machine: start it again
            if attempt == 2 or "timed out during startup" not in str(err):
                raise
            ray.shutdown()
            time.sleep(2.0 * (attempt + 1))
    try:
        yield
    finally:
        ray.shutdown()


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


def _of(evs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in evs if e["event"] == name]


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ---- fault-point actions run inside the workers (armed through their leader) ---------------


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


class _GradBytes:
    """Armed at ``worker.computed`` (a step's gradient computed, before the reduction): notes
    the bytes of this worker's gradient shards on the worker (``_bench_grad_bytes``)."""

    def __call__(self, *, worker: Any, step: int) -> None:
        from planaria.worker.sharded import local

        worker._bench_grad_bytes = sum(_nbytes(local(p.grad))
                                       for p in worker.state.model.parameters()
                                       if p.grad is not None)


class _KillAt:
    """Armed at ``worker.computed``: once ``step`` is computed, notes the time in ``marker``
    and SIGKILLs this worker (once)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker

    def __call__(self, *, worker: Any, step: int) -> None:
        if step == self.step and not os.path.exists(self.marker):
            Path(self.marker).write_text(json.dumps({"worker": worker.name, "t": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)


def _resident(worker: Any) -> dict[str, Any]:
    """What this worker holds of the replica's training state, in bytes."""
    import torch

    from planaria.worker.sharded import local

    params = list(worker.state.model.parameters())
    optim = [local(v) for state in worker.state.optimizer.state.values() for v in state.values()
             if torch.is_tensor(v)]
    grad = getattr(worker, "_bench_grad_bytes", None)
    return {
        "worker": worker.name,
        "param_bytes": sum(_nbytes(local(p)) for p in params),
        "grad_bytes": grad,
        "optimizer_bytes": sum(_nbytes(t) for t in optim),
        "params": sum(local(p).numel() for p in params),
        "full_params": sum(p.numel() for p in params),
        "dtensors": sum(hasattr(p, "to_local") for p in params),
    }


def _replica_resident(leader: Any) -> list[dict[str, Any]]:
    """On a leader: its own and each follower's :func:`_resident`, in shard order."""
    import ray

    return [_resident(leader), *ray.get([f.__ray_call__.remote(_resident)
                                         for f in leader.followers])]


def _install(job: Any, replica: str, hook: Any, index: int | None) -> None:
    """``hook`` armed at ``worker.computed`` on worker ``index`` of ``replica`` (0: its
    leader, None: every worker of the replica), through its leader."""
    import ray

    handle = next(h for h in job.members if h.name == replica)
    shards = range(job.config.workers_per_replica) if index is None else [index]
    ray.get([handle.actor.arm_fault.remote("worker.computed", hook, shard=i) for i in shards])


# ---- the three measurements ------------------------------------------------------------------


def measure_state(args: argparse.Namespace, k: int, run_dir: Path) -> dict[str, Any]:
    """1 replica x ``k`` workers, ``--state-steps`` steps; every worker's resident state."""
    import ray

    from planaria import Job, RunConfig

    config = RunConfig(steps=args.state_steps, replicas=1, workers_per_replica=k,
                       run_dir=run_dir, threads_per_worker=1)
    with _ray(), Job(make_spec(args), config) as job:
        _install(job, "w0", _GradBytes(), None)
        while job.steps_done < args.state_steps:
            job.run_steps(args.state_steps)
        leader = next(h for h in job.members if h.name == "w0")
        workers = ray.get(leader.actor.__ray_call__.remote(_replica_resident))
    for w in workers:
        if w["grad_bytes"] is None:
            raise RuntimeError(f"{w['worker']}: its gradient was never measured")
        w["total_bytes"] = w["param_bytes"] + w["grad_bytes"] + w["optimizer_bytes"]
    return {"bytes": max(w["total_bytes"] for w in workers), "workers": workers}


def planaria_steady(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """2 x 2 under the autonomous loop: the warm-up steps, then the rest in one run; the
    periods between rank 0's commits of the steady steps."""
    from planaria import Job, RunConfig

    config = RunConfig(steps=args.steps, replicas=REPLICAS, workers_per_replica=SHARDS,
                       run_dir=run_dir, threads_per_worker=1)
    with _ray(), Job(make_spec(args), config) as job:
        while job.steps_done < args.warmup:
            job.run_steps(args.warmup)  # the first step alone (it names the metrics), then a run
        t0 = time.perf_counter()
        while job.steps_done < args.steps:
            job.run_steps(args.steps)
        wall = time.perf_counter() - t0
    commits = {e["step"]: e for e in _of(_events(run_dir), "step_committed")}
    periods = [(commits[s]["t"] - commits[s - 1]["t"]) * 1000 for s in sorted(commits)
               if s > args.warmup and s - 1 in commits]
    widths = {commits[s]["width"] for s in commits}
    if widths != {REPLICAS}:
        raise RuntimeError(f"planaria's steady run changed width: {sorted(widths)}")
    return {"step_ms": periods, "step_ms_median": _med(periods),
            "wall_per_step_ms": wall * 1000 / (args.steps - args.warmup),
            "losses": {s: commits[s]["loss"] for s in commits}, "run_dir": str(run_dir)}


def planaria_recovery(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """2 x 2; w1.1 SIGKILLs itself once it computed ``--fault-step``; fit's loop until the
    replacement replica joined and a step committed at width 2."""
    import planaria
    from planaria import Job, RunConfig

    marker = run_dir.parent / f"{run_dir.name}.killed"
    marker.unlink(missing_ok=True)
    config = RunConfig(steps=_ENDLESS, replicas=REPLICAS, workers_per_replica=SHARDS,
                       run_dir=run_dir, threads_per_worker=1)
    with _ray(), Job(make_spec(args), config) as job:
        job.run_steps(1)  # the first step alone: the metrics are named
        _install(job, "w1", _KillAt(args.fault_step, str(marker)), 1)
        deadline = time.monotonic() + args.join_wait_s
        chunk = max(2, args.fault_step)
        while not _back_at_full_width(run_dir):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no step at width {REPLICAS} after the fault within "
                                   f"--join-wait-s={args.join_wait_s:g}")
            try:
                if job.steps_done >= args.fault_step + args.after_steps and job.width < REPLICAS:
                    job.wait_for_width(REPLICAS, timeout_s=left)  # then the join's first step
                job.run_steps(job.steps_done + chunk)
            except planaria.Failure as failure:
                job.recovery.handle(failure)
    if not marker.exists():
        raise RuntimeError("w1.1 was never killed")
    kill = json.loads(marker.read_text())
    return {**recovery_figures(_events(run_dir), kill["t"]), "killed": kill["worker"],
            "fault_step": args.fault_step, "run_dir": str(run_dir)}


def _back_at_full_width(run_dir: Path) -> bool:
    evs = _events(run_dir)
    joined = _of(evs, "joined")
    return bool(_of(evs, "fault")) and bool(joined) and any(
        e["width"] == REPLICAS and e["step"] >= joined[0]["step"]
        for e in _of(evs, "step_committed"))


def recovery_figures(evs: list[dict[str, Any]], kill_t: float) -> dict[str, Any]:
    """The recovery figures of the first fault (see the module doc)."""
    fault = _of(evs, "fault")[0]
    t_fault = float(fault["fault_t"])
    recovered = [e for e in _of(evs, "recovered") if e["fault_id"] == fault["fault_id"]]
    joined = _of(evs, "joined")
    commits = _of(evs, "step_committed")
    after = [e for e in commits if e["t"] > t_fault]
    full = [e for e in after if e["width"] == REPLICAS and joined
            and e["step"] >= joined[0]["step"]]
    detected = [e for e in _of(evs, "detected") if e["fault_id"] == fault["fault_id"]]
    ready = _of(evs, "replacement_ready")
    back_t = full[0]["t"] if full else None
    first_t = after[0]["t"] if after else None
    return {
        "recover_s": recovered[0]["recover_s"] if recovered else None,
        "back_at_full_width_s": back_t - t_fault if back_t is not None else None,
        "from_kill": {
            "recover_s": first_t - kill_t if first_t is not None else None,
            "back_at_full_width_s": back_t - kill_t if back_t is not None else None,
            "fault_t_minus_kill_s": t_fault - kill_t,
        },
        "fault": {k: fault.get(k) for k in ("kind", "worker", "step")},
        "detect_s": detected[0]["detect_s"] if detected else None,
        "replacement_s": ready[0].get("replacement_s") if ready else None,
        "join_s": joined[0]["join_s"] if joined else None,
        "joined_at_step": joined[0]["step"] if joined else None,
        "lost_steps": recovered[0]["lost_steps"] if recovered else None,
        "width_after_fault": after[0]["width"] if after else None,
    }


# ---- the bench -------------------------------------------------------------------------------


def _hsdp(args: argparse.Namespace, workdir: Path, *, steps: int, warmup: int,
          global_loss: bool = False) -> dict[str, Any]:
    return run_hsdp_steady(steps, REPLICAS, SHARDS, 1, dim=args.dim, layers=args.layers,
                           global_batch=args.global_batch, micro_batch=args.micro_batch,
                           warmup=warmup, global_loss=global_loss, timeout_s=args.timeout_s,
                           workdir=workdir)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_sharded_"))
    wd.mkdir(parents=True, exist_ok=True)
    load_before = common.loadavg()
    t0 = time.time()
    print(f"sharded: tiny_gpt dim={args.dim} layers={args.layers}, global batch "
          f"{args.global_batch} / micro {args.micro_batch}, 1 thread a worker; state at k = "
          f"{', '.join(map(str, STATE_KS))}; {REPLICAS} x {SHARDS} step time, {args.rounds} "
          f"interleaved rounds of {args.steps} steps ({args.warmup} warm-up); one kill of w1.1 "
          f"at step {args.fault_step}", flush=True)

    state: dict[str, Any] = {}
    if not args.no_state:
        for k in STATE_KS:
            state[str(k)] = measure_state(args, k, wd / f"state_k{k}")
            w = state[str(k)]["workers"]
            print(f"  state, 1 x {k}: " + "; ".join(
                f"{r['worker']} {r['total_bytes'] / 1e6:.3f} MB (params {r['param_bytes']}, "
                f"grads {r['grad_bytes']}, optimizer {r['optimizer_bytes']} B)" for r in w)
                + f"; load {common.loadavg()}", flush=True)
    state_bytes = {k: v["bytes"] for k, v in state.items()}
    state_ratio = ({k: state_bytes[k] / state_bytes["1"] for k in state_bytes if k != "1"}
                   if "1" in state_bytes else {})

    pl_rounds: list[list[float]] = []
    tr_rounds: list[list[float]] = []
    per_round = []
    first_losses: dict[int, float] = {}
    for i in range(args.rounds):
        pl = planaria_steady(args, wd / f"planaria_steady_{i}")
        tr = _hsdp(args, wd / f"hsdp_{i}", steps=args.steps, warmup=args.warmup)
        if i == 0:
            first_losses = pl["losses"]
        pl_rounds.append(pl["step_ms"])
        tr_rounds.append(tr["step_ms"])
        row = {"step_ms": pl["step_ms_median"], "torchrun_hsdp_step_ms": tr["step_ms_median"]}
        row["ratio"] = row["step_ms"] / row["torchrun_hsdp_step_ms"]
        per_round.append(row)
        print(f"  round {i}: planaria {row['step_ms']:.1f} ms, torchrun HSDP "
              f"{row['torchrun_hsdp_step_ms']:.1f} ms, ratio {row['ratio']:.3f}; load "
              f"{common.loadavg()}", flush=True)
    step_ms = _med([x for r in pl_rounds for x in r])
    hsdp_ms = _med([x for r in tr_rounds for x in r])
    assert step_ms is not None and hsdp_ms is not None

    loss_check = None
    if args.loss_check:
        check = _hsdp(args, wd / "hsdp_loss_check", steps=args.steps, warmup=args.warmup,
                      global_loss=True)
        diffs = [abs(check["losses"][s] - first_losses[s]) for s in first_losses
                 if s in check["losses"]]
        loss_check = {"steps": len(diffs), "max_abs_diff": max(diffs) if diffs else None}
        print(f"  loss check: planaria vs HSDP over {len(diffs)} steps, max |diff| "
              f"{loss_check['max_abs_diff']}", flush=True)

    recovery: dict[str, Any] | None = None
    if not args.no_recovery:
        recovery = planaria_recovery(args, wd / "planaria_recovery")
        print(f"  recovery: recover_s {recovery['recover_s']}, back_at_full_width_s "
              f"{recovery['back_at_full_width_s']} (from the kill: {recovery['from_kill']}); "
              f"load {common.loadavg()}", flush=True)
    load_after = common.loadavg()

    print()
    if state_bytes:
        print(f"{'workers per replica':<22} {'state bytes/worker':>19} {'ratio to k=1':>13} "
              f"{'target':>7}")
        for key, b in state_bytes.items():
            target = STATE_TARGETS.get(key)
            ratio = state_ratio.get(key)
            print(f"{key:<22} {b:>19,} {'' if ratio is None else f'{ratio:.3f}':>13} "
                  f"{'' if target is None else f'<= {target}':>7}")
    print(f"step ms, {REPLICAS} x {SHARDS}: planaria {step_ms:.1f}, torchrun HSDP {hsdp_ms:.1f}, "
          f"ratio {step_ms / hsdp_ms:.3f} (target <= {RATIO_TARGET})")
    if recovery is not None:
        print(f"kill of {recovery['killed']}: recover_s {recovery['recover_s']}, "
              f"back_at_full_width_s {recovery['back_at_full_width_s']}, lost_steps "
              f"{recovery['lost_steps']}")
    print(f"load average before {load_before} after {load_after}; wall {time.time() - t0:.0f} s")

    out = {
        "bench": "sharded",
        "state_bytes_per_worker": state_bytes,
        "state_ratio": state_ratio,
        "state_ratio_targets": STATE_TARGETS,
        "state_detail": {k: v["workers"] for k, v in state.items()},
        "step_ms": step_ms,
        "torchrun_hsdp_step_ms": hsdp_ms,
        "ratio": step_ms / hsdp_ms,
        "ratio_target": RATIO_TARGET,
        "ratio_per_round_median": _med([r["ratio"] for r in per_round]),
        "per_round": per_round,
        "loss_check": loss_check,
        "recover_s": None if recovery is None else recovery["recover_s"],
        "back_at_full_width_s": None if recovery is None else recovery["back_at_full_width_s"],
        "recovery": recovery,
        "dim": args.dim,
        "layers": args.layers,
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "replicas": REPLICAS,
        "workers_per_replica": SHARDS,
        "threads": 1,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "fault_step": args.fault_step,
        "quick": args.quick,
        "loadavg": {"before": load_before, "after": load_after},
        "nproc": os.cpu_count(),
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
