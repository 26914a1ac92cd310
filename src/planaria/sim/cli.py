"""``planaria plan``: which strategy and checkpoint interval a job should use, by simulation."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from planaria.sim.params import STRATEGIES, SimParams
from planaria.sim.result import SimResult
from planaria.sim.search import Plan, best_interval, plan

__all__ = ["add_plan_arguments", "plan_main", "plot_sizes"]

# flag → SimParams field; all default to None so that a flag overrides a calibrated figure.
_FLAGS: dict[str, tuple[str, type, str]] = {
    "--nodes": ("nodes", int, "nodes in the job"),
    "--gpus-per-node": ("gpus_per_node", int, "GPUs per node (default 8)"),
    "--nodes-per-replica": ("nodes_per_replica", int,
                            "nodes per data-parallel replica (one node's failure takes it out)"),
    "--node-mtbf-hours": ("node_mtbf_h", float, "mean time between failures of one node"),
    "--weibull-shape": ("weibull_shape", float, "failure process shape (1: exponential)"),
    "--preempt-mtbf-hours": ("preempt_mtbf_h", float, "mean time between preemptions of a node"),
    "--preempt-notice-s": ("preempt_notice_s", float, "warning a preemption gives"),
    "--step-s": ("step_s", float, "step time at full width"),
    "--width-exponent": ("width_exponent", float, "step time ∝ (full/width)^this"),
    "--detect-s": ("detect_s", float, "failure → detected"),
    "--rebuild-s": ("rebuild_s", float, "survivors build a new process group"),
    "--replacement-s": ("replacement_s", float, "replacement asked → ready (mean)"),
    "--replacement-cv": ("replacement_cv", float, "its coefficient of variation"),
    "--spares": ("spares", int, "hot-spare nodes"),
    "--spare-swap-s": ("spare_swap_s", float, "swapping in a spare"),
    "--join-s": ("join_stall_s", float, "the stall a hot-join costs the job"),
    "--restart-s": ("restart_s", float, "a full job restart (requeue, start, rendezvous)"),
    "--restore-s": ("restore_s", float, "loading a checkpoint"),
    "--ckpt-stall-s": ("ckpt_stall_s", float, "a save blocks training this long"),
    "--ckpt-write-s": ("ckpt_write_s", float, "background write after the stall"),
    "--days": ("days", float, "the job's length (default 30)"),
}


_SHORT = {"checkpoint_stall": "ckpt stall", "wasted_steps": "wasted",
          "waiting_for_replicas": "waiting", "reduced_width": "reduced"}


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-run", type=Path, default=None, metavar="RUN_DIR",
                   help="take detect, recover, join, restore, stall and step figures from a run")
    for flag, (_, kind, text) in _FLAGS.items():
        p.add_argument(flag, type=kind, default=None, help=text)
    p.add_argument("--seeds", type=int, default=3, help="runs averaged per candidate")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--png", type=Path, default=None, help="goodput against job size, per strategy")


def params_from_args(args: argparse.Namespace) -> SimParams:
    from planaria.faults.errors import ConfigError

    base: dict[str, Any] = {}
    if args.from_run is not None:
        from planaria.sim.calibrate import calibrate

        cal = calibrate(args.from_run)
        skip = ("startup_s", "shutdown_s")  # the run's own, not the planned job's
        base = {k: v for k, v in cal.figures.items() if v is not None and k not in skip}
        base["nodes"] = cal.params.nodes
    for field, _, _ in _FLAGS.values():
        if getattr(args, field_attr(field), None) is not None:
            base[field] = getattr(args, field_attr(field))
    if "nodes" not in base:
        raise ConfigError("nodes=None is not valid: give --nodes N (or --from-run RUN_DIR)")
    return SimParams(**base)


def field_attr(field: str) -> str:
    flag = next(f for f, (name, _, _) in _FLAGS.items() if name == field)
    return flag.lstrip("-").replace("-", "_")


def render(result: Plan, params: SimParams) -> None:
    from rich.console import Console
    from rich.table import Table

    used = [b for b in SimResult.BUCKETS
            if any(sp.badput.get(b, 0.0) >= 5e-4 for sp in result.strategies.values())]
    table = Table(title=f"{params.gpus:,} GPUs ({params.nodes:,} nodes, {params.replicas:,} "
                        f"replicas), {params.days:g} days, job MTBF "
                        f"{result.job_mtbf_s / 3600:.3g} h")
    for col in ("strategy", "goodput", "save every", *(_SHORT.get(b, b) for b in used)):
        table.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for name, sp in result.strategies.items():
        every = "-" if sp.interval_s is None else f"{sp.interval_s / 60:.3g} min"
        mark = " *" if name == result.recommended else ""
        table.add_row(name + mark, f"{100 * sp.goodput:.1f}%", every,
                      *(f"{100 * sp.badput[b]:.1f}%" for b in used))
    console = Console(width=max(Console().width, 120))
    console.print(table)
    console.print(f"Daly's interval for the job: {result.daly_interval_s / 60:.3g} min")
    console.print(f"recommended: [bold]{result.recommended}[/bold]: {result.why}")


def plot_sizes(params: SimParams, path: Path, *, seeds: tuple[int, ...] = (0,)) -> Path:
    """Goodput against job size (GPUs) for each strategy, each at its best interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = params.nodes_per_replica
    sizes = sorted({max(k, int(params.nodes * 2.0**e) // k * k) for e in range(-4, 4)})
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for strategy in STRATEGIES:
        goodput = [best_interval(params.with_(nodes=n), strategy, seeds=seeds, refine=3).goodput
                   for n in sizes]
        ax.plot([n * params.gpus_per_node for n in sizes], [100 * g for g in goodput],
                marker="o", label=strategy)
    ax.axvline(params.gpus, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput at the best interval (%)")
    ax.set_title(f"node MTBF {params.node_mtbf_h:g} h, replacement {params.replacement_s:g} s, "
                 f"restart {params.restart_s:g} s", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plan_main(args: argparse.Namespace) -> int:
    from planaria.faults.errors import ConfigError

    if args.seeds < 1:
        raise ConfigError(f"seeds={args.seeds} is not valid: an integer >= 1")
    params = params_from_args(args)
    result = plan(params, seeds=tuple(range(args.seeds)))
    if args.png is not None:
        plot_sizes(params, args.png)
    if args.json:
        json.dump(result.to_json(), sys.stdout)
        sys.stdout.write("\n")
    else:
        render(result, params)
        if args.png is not None:
            print(f"picture: {args.png}")
    return 0
