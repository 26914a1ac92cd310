"""The controller's per-step cost against the number of workers: runs of steps against one
call per worker per step.

    python bench/dispatch.py                # 3 real workers; 3-48 protocol-only workers
    python bench/dispatch.py --quick        # smoke run

A controller that makes one Ray call per worker per step and waits for every answer
(planaria's old per-step protocol; ``Job.train_step`` is now a run of one step) pays
per worker per step; in runs (``Job.run_steps``, what ``fit`` uses: see
``planaria.control.run_ahead``) it makes one call per worker per *run* of steps and records
the steps from rank 0's records. Measured side by side:

- ``per_step_controller_ms[N]``: the autonomous loop with N protocol-only
  workers, each "running" its steps of ``--step-ms`` (a sleep) and answering
  with records of the real loop's shape (rank 0 all of them, the others their
  last), each loading the controller's store as a real worker does (planaria's
  heartbeat thread, only while it is one of the N, quiet while its run commits
  steps as a real one's is; on rank 0 the stop key's watch and the stream of
  records).
  The controller's CPU time (``time.process_time``: its main thread, Ray's
  threads and the store's in its process) over a run (dispatch, the wait loop
  with its poll, recording every step as an event-log line) is measured for runs of
  ``--short-run`` and ``--long-run`` steps: the slope between them is the cost
  of a step, ``per_run_controller_ms[N]`` the rest (one call per worker, paid
  once per run: at a generation, a checkpoint, a join, the end). The
  controller is on no step's critical path here: this is what it spends, not
  what the workers wait for. Every stand-in the largest count needs is started
  before the first count, and those a smaller count does not use idle: the
  machine carries the same processes at every N, so the figure's growth is
  the controller's own work, not more processes sharing the cores (on 2 cores,
  48 Ray workers slow the very same controller code by ~1.7x, which is the
  machine's, not the controller's);
- ``real_autonomous``: 3 real planaria workers on the tiny model under
  ``Job.run_steps``: the step period (from the commit times) and the
  controller's CPU per step, beside the per-step protocol's;

- ``old_per_step_controller_ms[N]``: one round of the step protocol's calls to
  N *protocol-only* workers (Ray actors that compute nothing and answer at once
  with a step result of planaria's shape): the dispatch of N
  calls with their arguments (ids of the step's share), and the same wait as
  ``Calls.gather`` (``ray.wait`` for the first answer, then a sweep). Worker
  compute is zero, so the round is all controller and transport; on this
  machine the N actors share its cores (labelled ``oversubscribed`` above the
  core count);
- ``real_workers_controller_ms``: with 3 real planaria workers on the tiny
  model one step at a time (``Job.train_step``), the step period minus the slowest
  worker's own data + compute + reduce + apply (``bench/overhead.py``'s
  ``controller_ms``).

The last line printed is one JSON object (``"bench": "dispatch"``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import common  # noqa: E402
from planaria.wire import store_keys  # noqa: E402
from planaria.wire.reports import (  # noqa: E402
    RunReport,
    Served,
    StepRecord,
    StepTotals,
    read_stream_chunk,
)


@ray.remote(num_cpus=0)
class ProtocolWorker:
    """Answers the step protocol's call at once, with a result of the real one's shape, and
    loads the controller's store as a real worker does: its heartbeat thread
    (``planaria.control.liveness.beat``), and on rank 0 of a run the stop key's watch
    (``KeyWatch``) and the stream of step records (``StepStream``), planaria's own code."""

    def __init__(self, name: str, host: str, port: int, heartbeat_s: float) -> None:
        import threading

        from planaria.wire.heartbeat import Heartbeat, beat, quiet_s
        from planaria.worker.collective import connect_store
        from planaria.worker.key_watch import KeyWatch

        self.name, self.phase, self.step_no, self.progress, self.beats = name, "idle", 0, 0, 0
        self._run_t: tuple[float, float, float] | None = None  # (first, end, step_s) in a run
        self._quiet_s = quiet_s(heartbeat_s)
        self._store = connect_store(host, port, timeout_s=30)
        self._keys = KeyWatch(lambda: connect_store(host, port, timeout_s=30))
        self._stop = threading.Event()

        def record() -> str:
            self.beats += 1
            return Heartbeat(self.beats, self.phase, self.step_no, 0, False,
                             self.progress).format()

        def quiet() -> bool:  # as Vitals.quiet: a step committed within quiet_s
            if self._run_t is None:
                return False
            first, end, step_s = self._run_t
            since = time.time() - first
            return step_s <= since <= end - first + self._quiet_s and (
                since % step_s < self._quiet_s or step_s < self._quiet_s)

        self._beat = lambda: threading.Thread(
            target=beat, daemon=True,
            args=(lambda: connect_store(host, port, timeout_s=30), name, record, self._stop,
                  heartbeat_s, quiet))
        self._beating: Any = None

    def enlist(self, member: bool) -> None:
        """Beats while in the measured job, as its workers do; an idle stand-in does not
        (the store would serve a larger job's heartbeats at every count)."""
        import threading

        if member and self._beating is None:
            self._stop = threading.Event()
            self._beating = self._beat()
            self._beating.start()
        elif not member and self._beating is not None:
            self._stop.set()
            self._beating.join()
            self._beating = None

    def step(self, gen: int, step: int, ids: Any, steps_done: int, next_ids: Any,
             *, skipped: int = -1) -> dict[str, Any]:
        return {"grad_norm": 1.0, "overflow": False, "loss_sum": 0.5, "n": len(ids),
                "metric_sums": {}, "ids": ids, "digests": None, "data_wait_s": 0.0,
                "compute_s": 0.0, "reduce_s": 0.0, "preempting": False}

    def run(self, gen: int, run_id: int, start: int, until: int, *, rank: int, step_s: float,
            ids: Any) -> RunReport:
        """The autonomous loop's call: ``until - start`` steps of ``step_s`` each, records of
        the real loop's shape (rank 0 returns every one, the others their last)."""
        from planaria.worker.run_loop import STOP_POLL_S, STREAM_S, StepStream

        # No wake-up per step: on a machine of few cores, dozens of stand-ins waking every
        # few ms would take the CPU from the controller whose cost is measured (real
        # workers are on other hosts). Rank 0 wakes every STREAM_S to stream, as the
        # real one does; the records are the same.
        first = time.time()

        served = Served(ids=[int(i) for i in ids], digests=None)

        def record(step: int) -> StepRecord:
            t0 = first + (step - start) * step_s
            return StepRecord(step=step, t0=t0, t=t0 + step_s, grad_norm=1.0, overflow=False,
                              finite=True, data_wait_s=0.0, global_loss_sum=32.0,
                              global_samples=64, global_metric_sums={}, served=served,
                              metric_sums={}, compute_s=step_s, reduce_s=0.0)

        key = store_keys.run_stop(gen, run_id)
        if rank == 0:
            self._keys.watch(key, STOP_POLL_S)
        self.phase, self.progress = "compute", self.progress + 1
        records: list[StepRecord] = []
        stream = StepStream(self._store, gen, run_id) if rank == 0 else None
        end = first + step_s * (until - start)
        self._run_t = (first, end, step_s)
        with self._keys.busy():
            while (now := time.time()) < end:
                time.sleep(min(STREAM_S, end - now) if stream else end - now)
                if stream is not None:
                    done = min(until, start + int((time.time() - first) / step_s))
                    records += [record(s) for s in range(start + len(records), done)]
                    stream.publish(records, len(records))
                self.progress += 1
        self._keys.forget(key)
        self._run_t = None
        records += [record(s) for s in range(start + len(records), until)]
        self.phase, self.step_no = "idle", until
        return RunReport(steps=records if rank == 0 else records[-1:], ended="until",
                         steps_done=until, preempting=False)


def _gather(refs: list[Any]) -> list[Any]:
    """``Calls.gather``'s wait for a step (``planaria.control.call_watch.CallWatch``): every call's
    answer as it comes."""
    from planaria.control.call_watch import CallWatch

    calls, out = CallWatch(refs), []
    while len(calls):
        out += ray.get(calls.wait(0.25))
    return out


def protocol_rounds(workers: list[Any], rounds: int, warmup: int) -> float:
    """Median ms of one step's round of calls to the protocol-only ``workers``."""
    n = len(workers)
    batch = np.arange(common.GLOBAL_BATCH, dtype=np.int64)
    parts = np.array_split(batch, n)
    times = []
    for step in range(rounds + warmup):
        t0 = time.perf_counter()
        refs = [w.step.remote(0, step, parts[r], step, parts[r], skipped=-1)
                for r, w in enumerate(workers)]
        _gather(refs)
        if step >= warmup:
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def autonomous_runs(workers: list[Any], store: Any, repeats: int, short: int, long: int,
                    step_s: float, log_dir: Path) -> dict[str, float]:
    """The controller's CPU cost of the autonomous loop on ``n`` protocol-only workers:
    runs of ``short`` and of ``long`` steps, alternated, ``repeats`` of each; the CPU time
    of a run (dispatch, ``Calls.gather``'s wait loop with a poll between waits as
    ``RunAhead`` polls: rank 0's stream read and recorded as an event-log line a step,
    the rest when the run ends; the store serving every worker's heartbeat and rank 0's
    keys, in this process as in the controller's) is ``per_run + steps * per_step``:
    ``per_step_ms`` is the slope between the two lengths' medians (the cost of one more
    step), ``per_run_ms`` what is left (the calls to every worker, paid once per run: at a
    generation, a checkpoint, a join)."""
    from planaria.control.liveness import Liveness
    from planaria.observe.events import EventLog

    n = len(workers)
    names = [f"w{r}" for r in range(n)]
    ranks = frozenset(names)
    parts = np.array_split(np.arange(common.GLOBAL_BATCH, dtype=np.int64), n)
    log = EventLog(log_dir / f"events_{n}.jsonl")
    liveness = Liveness(store, timeout_s=3.0)

    def record(rec: StepTotals) -> None:  # Job.record_step's event-log line
        log.emit("step_committed", t=rec.t, step=rec.step, gen=0, width=n,
                 duration_s=rec.t - rec.t0, loss=rec.loss, samples=rec.global_samples,
                 data_wait_s=0.0, metrics={})

    cpu: dict[int, list[float]] = {short: [], long: []}
    start = 0
    for i in range(2 * repeats + 1):  # the first run warms up
        steps, run_id = (long if i % 2 else short), i + 1
        stream = _StreamReader(store, run_id, start, liveness, ranks, record)
        cpu0 = time.process_time()
        refs = [w.run.remote(0, run_id, start, start + steps, rank=r, step_s=step_s,
                             ids=parts[r])
                for r, w in enumerate(workers)]
        results = _gather_polling(refs, names, stream.poll, liveness)
        for rec in results[0].steps:
            if rec.step >= stream.recorded:
                record(rec)
        for chunk in range(stream.chunks):  # RunAhead._clear
            store.delete_key(store_keys.run_stream(0, run_id, chunk))
        store.delete_key(store_keys.run_stream(0, run_id))
        store.delete_key(store_keys.run_stop(0, run_id))
        if i:
            cpu[steps].append((time.process_time() - cpu0) * 1000)
        start += steps
    log.close()
    c_short, c_long = statistics.median(cpu[short]), statistics.median(cpu[long])
    per_step = max(0.0, (c_long - c_short) / (long - short))
    return {"per_step_ms": per_step, "per_run_ms": c_short - short * per_step,
            "short_run_ms": c_short, "long_run_ms": c_long}


class _StreamReader:
    """``RunAhead._poll`` for one run: rank 0's stream read, each new step recorded once,
    the run's ranks vouched for when steps come (``boundary_wanted`` is a local check)."""

    def __init__(self, store: Any, run_id: int, start: int, liveness: Any,
                 ranks: frozenset[str], record: Any) -> None:
        self.store, self.run_id, self.recorded = store, run_id, start
        self.liveness, self.ranks, self.record = liveness, ranks, record
        self.chunks = 0

    def poll(self) -> None:

        key = store_keys.run_stream(0, self.run_id)
        if not self.store.check([key]):
            return
        count = int(self.store.get(key))
        if count > self.chunks:
            self.liveness.vouch(self.ranks)
        while self.chunks < count:
            raw = self.store.get(store_keys.run_stream(0, self.run_id, self.chunks))
            self.chunks += 1
            for rec in read_stream_chunk(raw):
                if rec.step >= self.recorded:
                    self.record(rec)
                    self.recorded = rec.step + 1


def _gather_polling(refs: list[Any], names: list[str], poll: Any, liveness: Any) -> list[Any]:
    """``Calls.gather``'s wait for a run: every call's answer as it comes
    (``CallWatch``), the poll between waits, the heartbeats of the pending read unless the
    stream vouched for them (``Liveness``); answers in the order of ``refs``."""
    from planaria.control.call_watch import CallWatch

    index = {ref: i for i, ref in enumerate(refs)}
    out: list[Any] = [None] * len(refs)
    calls = CallWatch(refs)
    liveness.watch(names)
    while len(calls):
        for ref in calls.wait(0.25):
            out[index[ref]] = ray.get(ref)
        if not len(calls):
            break
        poll()
        if liveness.vouched_recently():
            continue
        liveness.hung([names[index[r]] for r in calls.pending], 600.0)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="3,8,16,32,48")
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--real-steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5,
                   help="autonomous runs of each length per worker count")
    p.add_argument("--short-run", type=int, default=40, help="steps in a short run")
    p.add_argument("--long-run", type=int, default=1240, help="steps in a long run")
    p.add_argument("--step-ms", type=float, default=5.0, help="a protocol-only step's time")
    p.add_argument("--heartbeat-s", type=float, default=0.25,
                   help="the stand-ins' heartbeat period (HangConfig.heartbeat_s's default)")
    p.add_argument("--overhead-rounds", type=int, default=1,
                   help="rounds of bench/overhead.py's comparison with DDP (small and tiny "
                        "models) for overhead_ratio_small/tiny; 0 skips (its own run has 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: few workers, few rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.rounds, args.warmup, args.real_steps = "3,8", 20, 5, 12
        args.repeats, args.short_run, args.long_run = 2, 10, 30
        args.overhead_rounds = 0
    counts = [int(x) for x in args.workers.split(",")]
    cores = os.cpu_count() or 1
    load_before = common.loadavg()
    ray.init(address="local", num_cpus=max(8, cores), include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_dispatch_log_"))
    try:
        # Every stand-in the largest count needs is started first and idles when a smaller
        # job does not use it: the machine carries the same processes at every count, so
        # what changes with N is the controller's own work, not how many processes share
        # the cores (48 Ray workers on 2 cores slow the same controller code ~1.7x).
        # The controller's store, in this process as in the controller's: every stand-in's
        # heartbeat and rank 0's keys are served here, and that CPU counts.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        pool = [ProtocolWorker.remote(f"w{i}", "127.0.0.1", store.port,  # type: ignore[attr-defined]
                                      args.heartbeat_s)
                for i in range(max(counts))]
        ray.get([w.__ray_ready__.remote() for w in pool])
        old, new, per_run = {}, {}, {}
        for n in counts:  # side by side, per worker count
            ray.get([w.enlist.remote(i < n) for i, w in enumerate(pool)])
            old[str(n)] = protocol_rounds(pool[:n], args.rounds, args.warmup)
            a = autonomous_runs(pool[:n], store, args.repeats, args.short_run, args.long_run,
                                args.step_ms / 1000, log_dir)
            new[str(n)], per_run[str(n)] = a["per_step_ms"], a["per_run_ms"]
            label = " (oversubscribed)" if n > cores else ""
            print(f"  {n:3d} protocol-only workers{label}: per-step protocol "
                  f"{old[str(n)]:.2f} ms a step; autonomous loop {new[str(n)]:.3f} ms of "
                  f"controller CPU a step and {per_run[str(n)]:.1f} ms a run (runs of "
                  f"{args.short_run}: {a['short_run_ms']:.1f} ms, of {args.long_run}: "
                  f"{a['long_run_ms']:.1f} ms)", flush=True)
    finally:
        ray.shutdown()
    from bench.planaria_side import run_planaria_steady

    # planaria starts its own Ray (with the bench's modules on the workers' path)
    real = run_planaria_steady(args.real_steps, "tiny", 3, 1,
                               warmup=min(10, args.real_steps // 3),
                               run_dir=Path(tempfile.mkdtemp(prefix="bench_dispatch_")),
                               driver="train_step")
    auto = run_planaria_steady(args.real_steps, "tiny", 3, 1,
                               warmup=min(10, args.real_steps // 3),
                               run_dir=Path(tempfile.mkdtemp(prefix="bench_dispatch_")),
                               driver="run_steps")
    overhead = None
    if args.overhead_rounds > 0:
        from bench import overhead as overhead_bench

        print(f"bench/overhead.py, {args.overhead_rounds} round(s):", flush=True)
        overhead = overhead_bench.main(["--rounds", str(args.overhead_rounds)])
    first, last = str(counts[0]), str(counts[-1])
    out = {
        "bench": "dispatch",
        "protocol": "autonomous loop (Job.run_steps) beside the per-step protocol "
                    "(Job.train_step)",
        "per_step_controller_ms": new,
        "growth_last_over_first": new[last] / new[first],
        "old_per_step_controller_ms": old,
        "old_growth_last_over_first": old[last] / old[first],
        "per_run_controller_ms": per_run,
        "run_lengths": [args.short_run, args.long_run],
        "step_ms": args.step_ms,
        "heartbeat_s": args.heartbeat_s,
        "real_autonomous": {k: auto[k] for k in ("step_ms_median", "controller_cpu_ms")},
        "real_per_step": {k: real[k] for k in ("step_ms_median", "controller_cpu_ms")},
        "real_workers_controller_ms": real["controller_ms_median"],
        "real_workers_transport_ms": real["transport_ms_median"],
        "real_workers_step_ms": real["step_ms_median"],
        "overhead_ratio_small": None if overhead is None else overhead["ratio"],
        "overhead_ratio_tiny": None if overhead is None or overhead["tiny"] is None
        else overhead["tiny"]["ratio"],
        "overhead_rounds": args.overhead_rounds,
        "cores": cores,
        "oversubscribed_above": cores,
        "loadavg": {"before": load_before, "after": common.loadavg()},
    }
    print(f"autonomous loop: {new[first]:.3f} ms of controller CPU a step at {first} workers, "
          f"{new[last]:.3f} ms at {last} ({out['growth_last_over_first']:.2f}x); per-step "
          f"protocol: {old[first]:.2f} ms a step at {first}, {old[last]:.2f} ms at {last} "
          f"({out['old_growth_last_over_first']:.1f}x)")
    print(f"3 real workers (tiny model): step {auto['step_ms_median']:.2f} ms autonomous, "
          f"{real['step_ms_median']:.2f} ms per step; controller CPU a step "
          f"{auto['controller_cpu_ms']:.3f} ms autonomous, {real['controller_cpu_ms']:.3f} ms "
          "per step")
    if overhead is not None:
        print(f"overhead against DDP ({args.overhead_rounds} round(s)): small "
              f"{out['overhead_ratio_small']:.3f}, tiny {out['overhead_ratio_tiny']:.3f}")
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
