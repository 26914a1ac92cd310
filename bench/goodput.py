"""Goodput under repeated faults: every system under the same seeded SIGKILLs, repeated.

    python bench/goodput.py --regime fast          # today's: medium model, 600 s, a kill every 30 s
    python bench/goodput.py --regime realistic     # ~1 s steps, >= 1 GB state, 1200 s, every 60 s
    python bench/goodput.py --dry-run ...          # the plan and its compute budget, then exit
    python bench/goodput.py --quick --repeats 2 --systems planaria_spares,torchrun  # smoke
    python bench/goodput.py --rescore DIR          # the result again from DIR's raw records

The compute budget is printed before anything runs: systems (each configuration a run) x
repeats x (window + start-up), plus one fault-free control run per system (``--dry-run``
prints it and exits).

Regimes. ``fast`` (today's): ``bench.common``'s ``medium`` model, a window of 600 s, a
kill every 30 s. ``realistic``: the ``realistic`` size (``common.SIZES["realistic"]``:
>= 1 GB of training state per replica, ~1 s steps), a window of 1200 s per system, a kill
every 60 s (``--kill-every-s 30`` for the other rate). Both: 3 replicas x 1 torch thread,
global batch 48 in micro-batches of 8, Adam; planaria with spares has 3 replicas + 1 spare.

What is measured. One kill harness in this process (``bench/kill_harness.py``) SIGKILLs
one active training worker about every ``--kill-every-s`` (a seeded jitter of up to a
quarter of that, a seeded pick among the active workers, a seeded point of a step; never
a planaria standby spare, the torchft lighthouse, torchrun's agent or Ray's own
processes). The window opens once a system has committed ``--warmup`` steps (and, with
spares, once its spare stands by): start-up is not measured.

Repeats. ``--repeats N`` (3) runs every system once per repeat (repeats
``--first-repeat`` .. + N - 1), the kill schedule's seed ``--seed + repeat``,
INTERLEAVED: repeat 0 runs every system, then repeat 1, ..., so that the machine's drift
hits all systems alike, and each repeat's runs are a pair (the same kills) for the ratios.

Parts (``--parts K``; the realistic regime's default 4, the fast regime's 1). Two runs of
20 minutes back to back sit 20 minutes apart, and on a shared 2-core host the speed
drifts by more than the few per cent between the systems over that time (measured: one
repeat's pair ran 30 % slower than the others, for both systems). So each repeat's
window is cut in K parts of ``window / K`` seconds, each a run of its own (a fresh job,
its window opening after its warm-up, as a whole run's does), run in turn with the
systems' order reversed every other part: A B, B A, A B, B A. Each system sees the host
of the same minutes, and a drift linear over the repeat hits both alike. The kills are
the whole window's seeded schedule, each part taking those due in its stretch (counted
from its own start): the same kills as a run of one part. A repeat's figures are its
parts' together, as if one window (``bench/goodput_parts.py``: counts add up, goodput,
samples/s and the floor are the parts' means weighted by their windows, percentiles over
kills are taken again over all the parts' kills); a repeat missing a part (a sitting cut
short) is left out and named in ``detail.incomplete``. Each part's start pays a fresh
start-up (not measured: the window opens after it) and a fresh full width: the same for
every system.
Before the repeats, one fault-free control run per system (``--control-s``, no kills)
gives its fault-free step rate, and reads the estimator on a
run without faults (it should read 1).

The systems (``--systems``, default all four):

- ``planaria_spares`` / ``planaria``: ``planaria.Job`` with ``RunConfig(replicas=3,
  spares=1 or 0)``, resize policy (survivors go on; a replacement, or the spare, hot-joins
  with the state from a survivor), the autonomous loop of ``fit()``
  (``bench/planaria_side.run_planaria_faults``).
- ``torchft``: one replica group per process and a lighthouse (``--min_replicas 1``,
  ``--join_timeout_ms 10000``), at the configuration its sweep found best
  (``bench/baselines/torchft_config.load_best``: heartbeat, quorum tick, gloo timeout,
  async quorum, warm standby); its gloo timeout, where the configuration leaves it open,
  resolved to 10 x the fault-free step of a run made before it (at least 2 s).
  ``--torchft-configs`` runs several configurations each repeat and takes the best per
  repeat (``torchft_runners.run_torchft_faults``).
- ``torchrun``: DDP with a checkpoint every N steps under ``torchrun --max-restarts``; N
  swept over ``--torchrun-ckpt-every`` (around the Young/Daly interval
  ``sqrt(2 x save time x time between kills)``, printed beside from the measured save
  time), the best per repeat (``runners.run_torchrun_faults``).

How the workload is sized, honestly. The default ``medium`` model takes 26-29 ms
a step (planaria, idle machine; 100 ms or more on a loaded one) with 3 replicas x
1 thread on the 2-core development machine; the 3 workers share 2 cores, so they
oversubscribe it, and the survivors of a kill get the core time the dead one
used: a missing replica costs less than a third of the throughput here (measured:
26 ms a step at width 3, 35-38 ms at width 2; on a machine with a core or a GPU
per replica it costs a third). How much it does cost is measured, not assumed:
``step_ms_by_width`` is each system's mean step time at each width it ran at.
Every process started after a kill (planaria's new standby spare or
replacement, torchft's replacement group, torchrun's restarted workers) also
runs on these 2 cores: starting one (Ray's worker or Python, importing torch,
building the model) slows the training steps beside it. Started cold, ~2
CPU-seconds a worker: measured for planaria with a spare, ~1 s of training time
lost per kill while the next spare started, against ~0.05 s when none was
started. planaria forks its workers from a server that imported torch once
(``RunConfig.warm_start``, on by default on one node; ``planaria.worker.forkserver``):
~0.7 CPU-seconds a start, the steps back at full speed ~2 s after a kill. The
peers start their processes as their maintainers do (a fresh Python each). On
a cluster a spare starts on resources of its own and that cost is not there.

The estimators, fixed before any run (change them only before a run, never after):

- per run, ``goodput`` = the sum over the window's useful (first-time committed) steps of
  their stretch's fault-free step time, over the window (= useful steps x fault-free step
  time ÷ window). The fault-free step time is, per stretch between kills, the MEAN of the
  gaps between consecutive full-width commits away from kills (details below). The mean,
  because n steps take n mean gaps: the median of skewed gaps reads a run without any
  fault below 1 (measured ~0.98 for planaria's 3 workers on 2 cores); per stretch, because
  the machine's speed drifts over a window. The control runs check it: a run without
  faults must read ~1. ``samples_per_s`` = useful steps x global batch ÷ window.
- across repeats, a system's figure is the MEDIAN of its per-run values, with a
  percentile-bootstrap 95 % interval over the runs (``bench/stats.py``: fixed seed, 4000
  resamples).
- ratios: the median of the per-repeat paired ratios (planaria ÷ the peer, in the same
  repeat, under the same kills), with the paired bootstrap interval (repeat indices
  resampled, so the runs made side by side stay together). planaria's configuration for
  them is fixed before the runs: no spare (``goodput_summary.HEADLINE``: charged per slot,
  a spare gives up a quarter of 4 slots, more than it wins back at these kill rates).
  Against the *best peer*: in each repeat, the highest per-slot figure among torchft's and
  torchrun's configurations: the conservative choice (the peers get the best of their
  sweeps, planaria one configuration). planaria with a spare gets the same ratios, per
  slot, beside (``detail.spares_ratio_*``).
- spares are charged per provisioned slot: a figure per slot = figure x replicas ÷ slots
  (planaria with 3 replicas + 1 spare: x 3/4; torchft with a warm standby: x 3/4). The
  ratios use the per-slot figures; planaria with spares reports both.
- a claim: "ahead" only if the ratio's interval's low end is above 1; a target "met" only
  if the interval is on the right side of it (``stats.ahead``, ``stats.met``).
- ``floor`` (each planaria configuration) = 1 - kills x (detect + lost work + transfer
  stall) ÷ window from its measured parts, each a mean per kill: detect = the harness's
  SIGKILL → planaria's ``fault`` record; lost work = ``lost_work_per_kill_steps`` x the
  fault-free step time, where ``lost_work_per_kill_steps`` is the mean over kills of
  ``(redone - unstarted) / total`` micro-batches of the ``step_resumed`` record after the
  kill: those computed again less those a survivor had not begun, the dead ranks' share
  (0 for a kill after which none came: the step had committed; null, not measured, when
  the run logged none);
  transfer stall = the window's ``state_transfer`` seconds (the survivors wait at the step
  boundary while a survivor sends the state; a transfer ``beside`` the step: the model's
  part, plus what the generation's first step took over the fault-free step, the joiner
  waiting there for the rest) ÷ kills. Targets: goodput >= 0.985 and within
  1 point of the floor; the ratios ahead.

Figures (per system, same definitions for all; times are ``time.time()`` in this
process and the workers, one clock). A *commit* is a step committed (planaria's
``step_committed``, rank 0's logged step under torchrun, the earliest group's
committed step under torchft); the window is ``[t0, t0 + duration_s]``.

- ``useful_steps``: steps committed in the window for the first time (a step
  beyond every step committed before); ``lost_steps``: commits in the window of
  steps committed before (recomputed work: torchrun's steps since the
  checkpoint); ``steps_committed``: both.
- fault-free step time: for each stretch of the window between kills, the mean
  time between full-width commits of consecutive steps, leaving out the 10 s
  after the kill that opens it and every gap while a hot spare starts (from its
  ``spare_requested`` to its setup's end, ``worker_started`` or ``spare_ready``: a
  fault-free run starts none, and on cores the workers share its start slows their
  steps, a cost of the kill that used the last spare; since 6b9afb8, chosen before
  its runs. Where spares start for most of the window, as in ec75ecb's sittings
  (30-57 s of each 60), few gaps are left and the figure is unstable: those results
  keep the estimator they were made with) (a stretch with fewer than 5 such gaps
  takes the whole window's mean; with fewer than 5 in the window, every full-width
  pair with no kill between counts). The mean, because n steps take n mean gaps (a
  median reads a run without faults below 1 when the gaps are skewed); per
  stretch, because this machine's speed drifts over ten minutes. What a system
  pays without faults is in it: torchrun's checkpoint saves, planaria's run
  boundaries. ``step_ms`` is its mean over the useful steps.
- ``goodput`` = the sum over useful steps of their stretch's fault-free step
  time, over the window (= ``useful_steps x step_ms / window``): the share of
  the window the system would have needed without faults for what it achieved.
- per kill, as in ``bench/baselines/runners.py``: ``s_max`` = highest step
  committed before the kill; ``recover_s`` = kill → next commit; ``mttr_s`` =
  ``back_s`` = kill → first commit of a step beyond ``s_max`` (new progress);
  ``full_width_s`` = kill → first commit at full width (every replica in);
  p50 and p99 over the kills (linear between closest ranks), each counting only
  commits inside the window. One refinement over runners.py, for every system:
  a step that was running when the kill came and still committed (its
  all-reduce was done before the kill) is progress made before the fault, not
  a recovery: it counts in ``s_max``, and "next commit" means the next commit
  of a step begun after the kill (each system logs when a step began: its
  commit time minus its own step duration). Without it a kill landing just
  after an all-reduce reads as a recovery in a few milliseconds.
- ``recoveries``: kills followed by new progress inside the window; ``kills``:
  kills sent; ``skipped_kills``: kills due while no worker was active (a system
  still restarting) until the next one was due.

Output. The last line printed is one JSON object: ``{"bench": "goodput", "regime",
"commit", "planaria": {"goodput", "floor", "samples_per_s", "lost_work_per_kill_steps",
...per slot, intervals, targets}, "planaria_spares": {the same}, "peers": {NAME:
{"config", "goodput", "samples_per_s"}}, "ratio_goodput_vs_best_peer": {"median", "ci95": [lo, hi]},
"ratio_samples_per_s_vs_best_peer": {"median", "ci95": [lo, hi]}}`` (peers' figures per
slot). Every run's raw record (commits, kills, window, configuration, seed, load average
before and after, the tree's commit, the command) goes to
``--raw-dir/goodput/<regime>/<commit>/<system>-r<repeat>[-p<part>].json`` (``bench/records.py``;
``--raw-dir`` defaults to ``bench/results/raw``, a ``--quick`` run's to its workdir), and
the summary with its ``detail`` (every run's figures, the controls, the ratio to each
peer) to ``bench/results/goodput-<regime>.json`` (a ``--quick`` run's to its workdir).
``--rescore`` computes the same JSON from the raw records alone (``bench/goodput_summary``).
A regime too long for one sitting (the realistic one: ~2 h a repeat) is made in several:
each adds repeats to one folder (``--into DIR --first-repeat K --repeats 1``), every record
naming the commit it ran at, and the result is scored from them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from bench import common, records  # noqa: E402
from bench.baselines import runners, torchft_runners  # noqa: E402
from bench.baselines.torchft_config import TorchftConfig, load_best  # noqa: E402
from bench.goodput_figures import window_figures  # noqa: E402
from bench.goodput_summary import run_figures, summarize  # noqa: E402
from bench.kill_harness import KillHarness, PlannedKill, plan_kills  # noqa: E402
from bench.planaria_side import run_planaria_faults  # noqa: E402

__all__ = ["REGIMES", "SYSTEMS", "Regime", "main", "plan_runs", "window_figures"]

PG_TIMEOUT_STEPS = 10
PG_TIMEOUT_FLOOR_S = 2.0
SYSTEMS = ("planaria_spares", "planaria", "torchft", "torchrun")


@dataclass(frozen=True, kw_only=True)
class Regime:
    """One regime's defaults."""

    size: str
    duration_s: float
    kill_every_s: float
    control_s: float
    startup_s: float
    """An estimate of a run's start-up and teardown, for the budget printed up front."""
    torchrun_ckpt_every: str
    parts: int = 1
    """Each repeat's window in this many parts, the systems alternating (``--parts``)."""


REGIMES = {
    "fast": Regime(size="medium", duration_s=600.0, kill_every_s=30.0, control_s=120.0,
                   startup_s=60.0, torchrun_ckpt_every="5,10,20"),
    "realistic": Regime(size="realistic", duration_s=1200.0, kill_every_s=60.0,
                        control_s=300.0, startup_s=30.0, torchrun_ckpt_every="8,16,32",
                        parts=4),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--regime", default="fast", choices=sorted(REGIMES))
    p.add_argument("--size", default=None, help="the model (default: the regime's)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--spares", type=int, default=1, help="planaria_spares' spares")
    p.add_argument("--duration-s", type=float, default=None, help="window per run")
    p.add_argument("--kill-every-s", type=float, default=None, help="time between kills")
    p.add_argument("--control-s", type=float, default=None, help="fault-free control window")
    p.add_argument("--no-controls", action="store_true", help="skip the control runs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="repeat r's kills use seed + r")
    p.add_argument("--first-repeat", type=int, default=0,
                   help="the repeats run are FIRST.. FIRST + REPEATS - 1 (a later sitting adds "
                   "repeats to earlier ones: with --into)")
    p.add_argument("--warmup", type=int, default=3, help="steps committed before the window")
    p.add_argument("--parts", type=int, default=None,
                   help="each repeat's window in PARTS runs, the systems alternating A B B A "
                   "... (default: the regime's; 1: one run a system a repeat)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"which systems, comma-separated, of {','.join(SYSTEMS)}")
    p.add_argument("--torchft-configs", default=None,
                   help="JSON files, comma-separated, each a TorchftConfig dict (or "
                   "{'config': {...}}): run each, best per repeat (default: the sweep's best)")
    p.add_argument("--torchrun-ckpt-every", default=None,
                   help="checkpoint intervals in steps (default: the regime's)")
    p.add_argument("--workdir", default=None, help="where runs write (default: a temp dir)")
    p.add_argument("--raw-dir", default=None,
                   help="where raw records go (default: bench/results/raw; --quick: WORKDIR/raw)")
    p.add_argument("--into", default=None, metavar="DIR",
                   help="write the raw records into DIR, not RAW_DIR's folder for this commit: "
                   "repeats made in several sittings (each record names its commit) score "
                   "together")
    p.add_argument("--summary", default=None, help="where the summary record goes (default: "
                   "bench/results/goodput-<regime>.json; --quick: WORKDIR)")
    p.add_argument("--rescore", nargs="?", const="", default=None, metavar="DIR",
                   help="run nothing: the result from DIR's raw records (default: the newest "
                   "under --raw-dir for the regime)")
    p.add_argument("--from-runs", action="store_true", help="the same as --rescore without DIR")
    p.add_argument("--dry-run", action="store_true", help="print the plan and budget, exit")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny model, 30 s windows, a kill every 10 s, no sweeps")
    args = p.parse_args(argv)
    regime = REGIMES[args.regime]
    if args.quick:
        regime = Regime(size="tiny", duration_s=30.0, kill_every_s=10.0, control_s=10.0,
                        startup_s=40.0, torchrun_ckpt_every="5")
    args.regime_name = "quick" if args.quick else args.regime
    if args.kill_every_s and not args.quick and args.kill_every_s != regime.kill_every_s:
        args.regime_name += f"-kill{args.kill_every_s:g}s"  # its own records and result
    args.size = args.size or regime.size
    args.duration_s = args.duration_s or regime.duration_s
    args.kill_every_s = args.kill_every_s or regime.kill_every_s
    args.control_s = args.control_s or regime.control_s
    args.startup_s = regime.startup_s
    args.parts = args.parts or regime.parts
    if args.parts < 1:
        p.error(f"--parts {args.parts}: give 1 (one run a system a repeat) or more")
    args.torchrun_ckpt_every = args.torchrun_ckpt_every or regime.torchrun_ckpt_every
    args.system_list = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(args.system_list) - set(SYSTEMS))
    if unknown:
        p.error(f"--systems: unknown {unknown}; known: {', '.join(SYSTEMS)}")
    if args.from_runs and args.rescore is None:
        args.rescore = ""
    if args.size not in common.SIZES:
        p.error(f"--regime {args.regime} needs the model size {args.size!r} in "
                f"bench/common.py's SIZES, which has {sorted(common.SIZES)}")
    return args


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True, kw_only=True)
class PlannedRun:
    """One run of the plan."""

    system: str
    variant: str
    """The system and its configuration, as a file name part (``torchrun_ckpt10``)."""
    kind: str
    """``"faults"`` (a repeat, under kills) or ``"control"`` (no kills)."""
    repeat: int
    seed: int
    config: dict[str, Any]
    part: int = 0
    """Which part of the repeat's window this run is (0 .. ``parts`` - 1)."""
    parts: int = 1

    @property
    def name(self) -> str:
        if self.kind == "control":
            return f"{self.variant}-control"
        return f"{self.variant}-r{self.repeat}" + (f"-p{self.part}" if self.parts > 1 else "")


def torchft_configs(option: str | None) -> list[TorchftConfig]:
    """``--torchft-configs``'s configurations, or the sweep's best."""
    if not option:
        return [load_best()]
    out = []
    for path in option.split(","):
        data = json.loads(Path(path).read_text())
        out.append(TorchftConfig.from_dict(data.get("config", data)))
    return out


def _variants(args: argparse.Namespace, system: str) -> list[tuple[str, dict[str, Any]]]:
    if system == "planaria_spares":
        return [(system, {"replicas": args.replicas, "spares": args.spares})]
    if system == "planaria":
        return [(system, {"replicas": args.replicas, "spares": 0})]
    if system == "torchft":
        return [("torchft_" + c.label().replace(" ", "_").replace(".", "p"), c.as_dict())
                for c in torchft_configs(args.torchft_configs)]
    return [(f"torchrun_ckpt{n}", {"ckpt_every": int(n)})
            for n in args.torchrun_ckpt_every.split(",") if n]


def plan_runs(args: argparse.Namespace) -> list[PlannedRun]:
    """The controls (one per system: its first configuration), then the repeats,
    interleaved: repeat 0 runs every system and configuration, then repeat 1, ... With
    ``parts`` > 1 each repeat's window is cut in parts run in turn, the order of the systems
    reversed every other part (A B, B A, A B, ...: each system's runs sit as early as the
    other's on average, so a drift of the machine's speed that is linear over the repeat
    hits both alike)."""
    plan: list[PlannedRun] = []
    if not args.no_controls:
        for system in args.system_list:
            variant, config = _variants(args, system)[len(_variants(args, system)) // 2]
            plan.append(PlannedRun(system=system, variant=variant, kind="control", repeat=-1,
                                   seed=args.seed, config=config))
    parts = args.parts
    for rep in range(args.first_repeat, args.first_repeat + args.repeats):
        for part in range(parts):
            systems = args.system_list if part % 2 == 0 else args.system_list[::-1]
            for system in systems:
                for variant, config in _variants(args, system):
                    plan.append(PlannedRun(system=system, variant=variant, kind="faults",
                                           repeat=rep, seed=args.seed + rep, config=config,
                                           part=part, parts=parts))
    return plan


def part_window(duration_s: float, planned: PlannedRun) -> tuple[float, float]:
    """A run's part of its repeat's window: its start (seconds into the whole window) and
    its length."""
    length = duration_s / planned.parts
    return planned.part * length, length


def part_kills(seed: int, every_s: float, duration_s: float, planned: PlannedRun
               ) -> list[PlannedKill]:
    """The kills of a part: the whole window's seeded schedule (the same kills as a run
    of one part), those due in this part, their times counted from its start."""
    start, length = part_window(duration_s, planned)
    return [dataclasses.replace(k, at_s=k.at_s - start)
            for k in plan_kills(seed, every_s, duration_s)
            if start <= k.at_s < start + length]


def budget_s(args: argparse.Namespace, plan: list[PlannedRun]) -> float:
    """The plan's wall time: each run's window plus the regime's start-up estimate."""
    return sum((args.control_s if r.kind == "control" else args.duration_s / r.parts)
               + args.startup_s for r in plan)


# ---------------------------------------------------------------- runs


def _slim(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """planaria's event log without what no figure reads (per-rank times, metrics)."""
    keep = ("event", "t", "step", "gen", "width", "duration_s", "data_wait_s", "samples")
    return [{k: e[k] for k in keep if k in e} if e.get("event") == "step_committed" else e
            for e in events]


def run_system(args: argparse.Namespace, planned: PlannedRun, wd: Path, step_s: float | None
               ) -> dict[str, Any]:
    """Runs one planned run; its raw measurements (and the configuration it ran)."""
    if planned.kind == "control":
        window, kills = args.control_s, []
    else:
        window = part_window(args.duration_s, planned)[1]
        kills = part_kills(planned.seed, args.kill_every_s, args.duration_s, planned)
    harness = KillHarness(kills)
    run_dir = wd / planned.name
    config = dict(planned.config)
    slots = args.replicas
    if planned.system.startswith("planaria"):
        run = run_planaria_faults(window, harness, args.size, args.replicas,
                                  config["spares"], warmup=args.warmup, run_dir=run_dir)
        run["events"] = _slim(run["events"])
        del run["commits"]  # the same as its log's step_committed records: rebuilt from them
        slots += config["spares"]
    elif planned.system == "torchft":
        ft = TorchftConfig.from_dict(config)
        if ft.pg_timeout_s is None:  # the rule: 10 x the step, at least 2 s
            ft = dataclasses.replace(ft, pg_timeout_s=round(max(
                PG_TIMEOUT_FLOOR_S, PG_TIMEOUT_STEPS * (step_s or 0.1)), 2))
        run = torchft_runners.run_torchft_faults(window, harness, args.size, args.replicas,
                                                 warmup=args.warmup, workdir=run_dir, config=ft)
        config["resolved"] = ft.as_dict()
        slots += int(ft.warm_standby)
    else:
        run = runners.run_torchrun_faults(window, harness, args.size, args.replicas,
                                          ckpt_every=config["ckpt_every"], warmup=args.warmup,
                                          workdir=run_dir)
    return {**run, "config": config, "slots": slots}


def _step_s_of(raw: dict[str, Any]) -> float | None:
    ms = run_figures(raw)["step_ms"]
    return None if ms is None else ms / 1000


def _say(lines: list[str], text: str) -> None:
    print(text, flush=True)
    lines.append(text)


def _rescore(args: argparse.Namespace, raw_root: Path) -> dict[str, Any]:
    folder = Path(args.rescore) if args.rescore else records.latest_raw_dir(
        raw_root, "goodput", args.regime_name)
    raws = records.read_raw(folder) if folder is not None and folder.is_dir() else {}
    if not raws:
        raise SystemExit(f"--rescore: no raw records in {folder or raw_root}; give the folder "
                         "of a finished run's raw records (or its --raw-dir / --workdir)")
    out = summarize(raws)
    if args.summary:
        records.save_record(Path(args.summary), "goodput", out, _command(raws),
                            commit=out["commit"], recomputed_from=str(folder),
                            machine_info=records.machine_of(raws))
    return out


def _command(raws: dict[str, dict[str, Any]]) -> str:
    """The commands that made these runs (several sittings: each, in order)."""
    return "; ".join(dict.fromkeys(str(r["command"]) for r in raws.values()
                                   if r.get("command")))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_goodput_"))
    raw_root = Path(args.raw_dir) if args.raw_dir else (
        wd / "raw" if args.quick else records.RAW_ROOT)
    if args.rescore is not None:
        out = _rescore(args, raw_root)
        shown = {k: v for k, v in out.items() if k != "detail"}
        print(json.dumps(shown), flush=True)
        return out
    plan = plan_runs(args)
    said: list[str] = []
    budget = budget_s(args, plan)
    _say(said, f"plan ({args.regime_name}): {len(plan)} runs, size={args.size}, "
         f"{args.replicas} replicas x 1 thread, window {args.duration_s:.0f} s"
         + (f" in {args.parts} parts of {args.duration_s / args.parts:.0f} s, the systems "
            "alternating" if args.parts > 1 else "") + ", a kill every "
         f"{args.kill_every_s:.0f} s, seeds {args.seed + args.first_repeat}.."
         f"{args.seed + args.first_repeat + args.repeats - 1}, "
         f"{os.cpu_count()} cores")
    for r in plan:
        at = ([round(k.at_s) for k in part_kills(r.seed, args.kill_every_s, args.duration_s, r)]
              if r.kind == "faults" and r.parts > 1 else None)
        _say(said, f"  {r.name}: {r.system} {json.dumps(r.config)} seed {r.seed}"
             + (f", kills at {at} s" if at is not None else ""))
    _say(said, f"compute budget: {budget / 60:.0f} min ({budget / 3600:.1f} h: runs x "
         f"(window + ~{args.startup_s:.0f} s start-up))")
    if args.dry_run:
        print(json.dumps({"bench": "goodput", "dry_run": True, "runs": len(plan),
                          "budget_s": round(budget)}), flush=True)
        return {}
    commit = records.tree_commit()
    folder = (Path(args.into) if args.into
              else records.raw_dir(raw_root, "goodput", args.regime_name, commit))
    if folder.is_dir() and records.read_raw(folder):
        _say(said, f"note: {folder} holds records already; they count in the result")
    command = shlex.join(["python", "bench/goodput.py", *(sys.argv[1:] if argv is None
                                                          else argv)])
    load_before, t_start = common.loadavg(), time.time()
    this_machine = records.machine()  # a sitting's runs share it
    step_s: float | None = None
    for planned in plan:
        _say(said, f"{planned.name} ...")
        before, t0 = common.loadavg(), time.time()
        run = run_system(args, planned, wd, step_s)
        raw = {**{k: v for k, v in run.items() if k != "run_dir"},
               "system": planned.system, "variant": planned.variant, "kind": planned.kind,
               "repeat": planned.repeat, "seed": planned.seed, "regime": args.regime_name,
               "part": planned.part, "parts": planned.parts,
               "part_start_s": part_window(args.duration_s, planned)[0],
               "size": args.size, "replicas": args.replicas, "duration_s": run["t1"] - run["t0"],
               "kill_every_s": args.kill_every_s, "global_batch": common.GLOBAL_BATCH,
               "loadavg_before": before, "loadavg_after": common.loadavg(),
               "wall_s": round(time.time() - t0, 1), "commit": commit, "command": command,
               "machine": this_machine}
        records.write_raw(folder, planned.name, raw)
        found = _step_s_of(raw)
        step_s = found if step_s is None or (found and found < step_s) else step_s
    out = summarize(records.read_raw(folder))
    _say(said, json.dumps(out["detail"]["runs"], indent=1))
    _say(said, f"controls: {json.dumps(out['detail']['controls'])}")
    load_after = common.loadavg()
    _say(said, f"load average before {load_before} after {load_after}; "
         f"wall {time.time() - t_start:.0f} s")
    summary = Path(args.summary) if args.summary else (
        wd / f"goodput-{args.regime_name}.json" if args.quick
        else records.RAW_ROOT.parent / f"goodput-{args.regime_name}.json")
    records.save_record(summary, "goodput", out, command, commit=commit,
                        loadavg_before=load_before, loadavg_after=load_after,
                        wall_s=round(time.time() - t_start, 1), raw_records=str(folder),
                        table=said)
    print(json.dumps({k: v for k, v in out.items() if k != "detail"}), flush=True)
    return out


if __name__ == "__main__":
    main()
