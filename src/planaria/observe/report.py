"""``planaria report RUN_DIR``: a terminal summary, a timeline picture and JSON.

Everything is computed by :func:`planaria.observe.metrics.summarize` from the run's
event log; this module only presents it.
"""

from __future__ import annotations

import itertools
import json as _json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from planaria.observe.events import read_events
from planaria.observe.metrics import RunSummary, Stats, summarize
from planaria.observe.rank_times import PARTS, RankSummary
from planaria.observe.segments import (
    UnknownRun,
    num,
    run_ids,
    select_run,
    split_runs,
    split_segments,
    throughput_series,
    width_series,
)

__all__ = ["plot_ranks", "plot_timeline", "render_ranks", "render_summary", "report_main"]

TIMELINE_PNG = "timeline.png"


def _s(value: float | None, unit: str = " s") -> str:
    return "-" if value is None else f"{value:.3g}{unit}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _metrics(metrics: Any) -> str:
    """``{"loss": 0.1234567}`` as ``loss 0.1235``."""
    if not isinstance(metrics, dict):
        return "-"
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, (int, float)) else f"{k} {v}"
                     for k, v in metrics.items())


def _eval_figures(e: dict[str, Any]) -> str:
    """An evaluation's one line: its step, figures and samples."""
    return f"step {e.get('step')}: {_metrics(e.get('metrics'))} ({e.get('samples')} samples)"


def _stats_row(name: str, st: Stats) -> list[str]:
    return [name, str(st.count), _s(st.p50), _s(st.p90), _s(st.max), _s(st.total)]


def render_summary(summary: RunSummary, console: Console) -> None:
    """Prints the run overview, the faults table and the badput table."""
    overview = Table(title=f"run {summary.run_id or '?'}", show_header=False)
    overview.add_column(style="bold")
    overview.add_column()
    steps = summary.steps
    done = f"{steps.get('committed', 0)}" + (f" / {steps['target']}" if steps.get("target") else "")
    rows = [
        ("status", summary.status + (f" ({summary.segments} segments)" if summary.segments > 1
                                     else "")),
        ("wall", _s(summary.wall_s)),
        ("steps committed", done),
        ("steps recomputed / failed", f"{steps.get('recomputed', 0)} / {steps.get('failed', 0)}"),
        ("goodput", _pct(summary.goodput)),
        ("replica efficiency", _pct(summary.replica_efficiency)),
        ("samples/s", _s(summary.samples_per_s, "")),
        ("faults", f"{len(summary.faults)} ({sum(not f.recovered for f in summary.faults)}"
                   " unrecovered)"),
        ("checkpoints", f"{summary.checkpoints.get('saved', 0)} saved, "
                        f"{summary.checkpoints.get('failed', 0)} failed, "
                        f"{summary.checkpoints.get('restores', 0)} restores"),
    ]
    if summary.evals:
        rows.append(("last eval", _eval_figures(summary.evals[-1])))
    for key, value in rows:
        overview.add_row(key, value)
    console.print(overview)
    if len(summary.evals) > 1:
        evals = Table(title="evaluations", box=None, pad_edge=False, padding=(0, 1, 0, 0),
                      header_style="bold underline")
        for col in ("step", "metrics", "samples", "seconds"):
            evals.add_column(col, justify="left" if col == "metrics" else "right")
        for e in summary.evals:
            evals.add_row(str(e.get("step")), _metrics(e.get("metrics")), str(e.get("samples")),
                          _s(num(e.get("seconds")), ""))
        console.print(evals)

    if summary.faults:
        faults = Table(title="faults (times in seconds)", box=None, pad_edge=False,
                       padding=(0, 1, 0, 0), header_style="bold underline")
        for col in ("id", "kind", "worker", "step", "action", "detect", "recover", "lost",
                    "repl.", "join", "restore"):
            left = col in ("id", "kind", "action")
            faults.add_column(col, justify="left" if left else "right", no_wrap=True)
        for f in summary.faults:
            faults.add_row(
                str(f.fault_id), str(f.kind), str(f.worker or "-"),
                "-" if f.step is None else str(f.step), f.action or "-", _s(f.detect_s, ""),
                _s(f.recover_s, "") if f.recovered else "[red]never[/red]",
                "-" if f.lost_steps is None else str(f.lost_steps),
                _s(f.replacement_s, ""), _s(f.join_s, ""), _s(f.restore_s, ""),
            )
        console.print(faults)
        stats = Table(title="recovery times")
        for col in ("", "n", "p50", "p90", "max", "total"):
            stats.add_column(col, justify="right")
        stats.add_row(*_stats_row("detect_s", summary.detect_s))
        stats.add_row(*_stats_row("recover_s", summary.recover_s))
        console.print(stats)

    if summary.wall_s > 0:
        badput = Table(title="where the time went")
        badput.add_column("bucket")
        badput.add_column("seconds", justify="right")
        badput.add_column("share", justify="right")
        badput.add_row("[green]goodput[/green]", f"{summary.goodput_s:.2f}", _pct(summary.goodput))
        for bucket, share in summary.badput.items():
            if summary.badput_s.get(bucket, 0.0) > 0:
                badput.add_row(bucket, f"{summary.badput_s[bucket]:.2f}", _pct(share))
        console.print(badput)
    if summary.ranks is not None and summary.ranks.ranks:
        render_ranks(summary.ranks, console)
    for warning in summary.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)


def render_ranks(ranks: RankSummary, console: Console) -> None:
    """The per-rank table: each rank's mean seconds per step of each part, the slowest
    named (the one the others' reduce-wait is spent on)."""
    table = Table(title=f"time per rank (mean s per step, width {ranks.width})", box=None,
                  pad_edge=False, padding=(0, 1, 0, 0), header_style="bold underline")
    for col in ("rank", "worker", "steps", *(p.replace("_", "-") for p in PARTS)):
        table.add_column(col, justify="left" if col == "worker" else "right")
    for m in ranks.ranks:
        mark = "[bold red]" if m.rank == ranks.slowest else ""
        table.add_row(f"{mark}{m.rank}", m.worker or "-", str(m.steps),
                      *(_s(getattr(m, p), "") for p in PARTS))
    console.print(table)
    if ranks.slowest is not None and len(ranks.ranks) > 1:
        who = f"rank {ranks.slowest}" + (f" ({ranks.slowest_worker})" if ranks.slowest_worker
                                          else "")
        console.print(f"slowest: {who}, in {ranks.slowest_part}: the others wait for it in "
                      "their reduce-wait", highlight=False)


_PART_COLOURS = {"load": "tab:orange", "compute": "tab:blue", "reduce_wait": "tab:red",
                 "apply": "tab:green"}


def plot_ranks(ax: Any, ranks: RankSummary) -> None:
    """The per-rank panel: a stacked bar per rank of its mean seconds per step in each part;
    the slowest rank's label in bold red."""
    xs = [m.rank for m in ranks.ranks]
    bottom = [0.0] * len(xs)
    for part in PARTS:
        heights = [getattr(m, part) or 0.0 for m in ranks.ranks]
        ax.bar(xs, heights, bottom=bottom, color=_PART_COLOURS[part],
               label=part.replace("_", "-"), width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    named = len(xs) <= 16  # a wide job's ticks: the ranks alone
    ax.set_xticks(xs, [f"{m.rank}" + (f"\n{m.worker}" if m.worker and named else "")
                       for m in ranks.ranks], fontsize=8 if named else 6)
    for label, m in zip(ax.get_xticklabels(), ranks.ranks, strict=True):
        if m.rank == ranks.slowest:
            label.set_color("red")
            label.set_fontweight("bold")
    ax.set_ylim(0, max(bottom, default=0.0) * 1.3 or 1.0)  # room for the legend
    ax.set_ylabel("s per step (mean)")
    ax.set_xlabel("rank" + (f" (slowest: {ranks.slowest}, in {ranks.slowest_part})"
                            if ranks.slowest is not None and len(xs) > 1 else ""))
    ax.legend(loc="upper right", fontsize=7, ncols=4)
    ax.grid(alpha=0.3, axis="y")


def _fault_label(f: Any) -> str:
    return f"{f.kind}" + (f" {f.worker}" if f.worker else "")


def plot_timeline(
    events: Sequence[dict[str, Any]], summary: RunSummary, png_path: str | Path
) -> Path:
    """Writes a three-panel timeline (samples/s, live replicas, loss) to ``png_path``, and
    a fourth, per-rank panel (:func:`plot_ranks`) when the steps say where each rank's
    time went.

    Faults are red vertical lines labelled with kind and worker, fault →
    recovered spans are shaded, checkpoint saves are green dotted lines, and
    the gaps between resumed runs are grey.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = summary.start_t if summary.start_t is not None else 0.0
    ranks = summary.ranks if summary.ranks is not None and summary.ranks.ranks else None
    fig = plt.figure(figsize=(11, 10 if ranks else 7.5), constrained_layout=True)
    grid = fig.add_gridspec(4 if ranks else 3, 1, height_ratios=[1, 1, 1, 1.1][: 4 if ranks else 3])
    ax_tp = fig.add_subplot(grid[0])
    ax_w = fig.add_subplot(grid[1], sharex=ax_tp)
    ax_loss = fig.add_subplot(grid[2], sharex=ax_tp)
    axes = (ax_tp, ax_w, ax_loss)
    for ax in (ax_tp, ax_w):
        ax.tick_params(labelbottom=False)
    segments = split_segments(events)
    tp = throughput_series(events)
    if tp:
        ax_tp.plot([t - t0 for t, _ in tp], [v for _, v in tp], ".-", ms=3, lw=0.8)
    ax_tp.set_ylabel("samples/s")
    widths = width_series(events)
    if widths:
        ax_w.step([t - t0 for t, _ in widths], [w for _, w in widths], where="post")
    if summary.target_replicas:
        ax_w.axhline(summary.target_replicas, color="grey", ls="--", lw=0.8, label="target")
        ax_w.set_ylim(-0.2, summary.target_replicas + 0.8)
    ax_w.set_ylabel("live replicas")
    loss = [(float(e["t"]) - t0, num(e.get("loss"))) for e in events
            if e["event"] == "step_committed"]
    loss_pts = [(t, v) for t, v in loss if v is not None]
    if loss_pts:
        ax_loss.plot([t for t, _ in loss_pts], [v for _, v in loss_pts], lw=0.9, color="tab:purple")
    ax_loss.set_ylabel("loss")
    ax_loss.set_xlabel("seconds since run start")

    for ax in axes:
        for f in summary.faults:
            end = f.recovered_t if f.recovered_t is not None else t0 + summary.wall_s
            ax.axvspan(f.fault_t - t0, end - t0, color="red", alpha=0.12, lw=0)
            ax.axvline(f.fault_t - t0, color="red", lw=1.0)
        for e in events:
            if e["event"] == "checkpoint_saved":
                ax.axvline(float(e["t"]) - t0, color="green", ls=":", lw=0.9)
            elif e["event"] == "restore":
                ax.axvline(float(e["t"]) - t0, color="orange", ls="--", lw=0.9)
        for before, after in itertools.pairwise(segments):
            ax.axvspan(before.end - t0, after.start - t0, color="grey", alpha=0.25, lw=0)
        ax.grid(alpha=0.3)
    top = ax_tp.get_ylim()[1]
    for f in summary.faults:
        ax_tp.annotate(_fault_label(f), (f.fault_t - t0, top), rotation=90, va="top", ha="right",
                       fontsize=8, color="red",
                       bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 1})
    if ranks is not None:
        plot_ranks(fig.add_subplot(grid[3]), ranks)
    title = (f"run {summary.run_id or '?'}: goodput {_pct(summary.goodput)}, "
             f"{len(summary.faults)} faults, wall {summary.wall_s:.1f} s "
             "(red: fault → recovered, green: checkpoint, orange: restore, grey: down)")
    fig.suptitle(title, fontsize=10)
    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def report_main(run_dir: str | Path, json: bool = False, png: str | Path | None = None,
                run: str | None = None, all_runs: bool = False) -> int:
    """The ``planaria report`` command: returns the exit status.

    Reports one run of the run dir's log (:func:`~planaria.observe.segments.select_run`):
    the latest, or the one ``run`` names. Writes its timeline to ``png`` (default
    ``RUN_DIR/timeline.png``) and prints the rich summary, or with ``json=True`` exactly
    one JSON object to stdout (``RunSummary.to_json()`` plus ``timeline_png`` and
    ``runs``: the ids of every run in the log, oldest first). ``all_runs``: a table of the
    log's runs instead (with ``json``: a JSON list of their summaries), no picture. 2 when
    there is no log or no such run.
    """
    try:
        read = read_events(run_dir)
    except FileNotFoundError as err:
        print(f"planaria report: {err}", file=sys.stderr)
        return 2
    runs = split_runs(read.events)
    if all_runs:
        return _report_runs(runs, read.warnings, json=json)
    try:
        events = select_run(read.events, run)
    except UnknownRun as err:
        print(f"planaria report: {err}", file=sys.stderr)
        return 2
    summary = summarize(events)
    summary.warnings = list(read.warnings) + summary.warnings
    base = Path(run_dir)
    default = (base if base.is_dir() else base.parent) / TIMELINE_PNG
    png_path = Path(png) if png is not None else default
    written: Path | None = None
    try:
        written = plot_timeline(events, summary, png_path)
    except OSError as err:
        summary.warnings.append(f"could not write {png_path}: {err}")
    config = _resolved_config(base if base.is_dir() else base.parent)
    if json:
        out = summary.to_json()
        out["timeline_png"] = str(written) if written else None
        out["config"] = config
        out["runs"] = [ids[0] for r in runs if (ids := run_ids(r))]
        sys.stdout.write(_json.dumps(out, default=str) + "\n")
        sys.stdout.flush()
    else:
        console = Console()
        if len(runs) > 1:
            which = "the latest" if run is None else f"run {summary.run_id}"
            console.print(f"this run dir holds {len(runs)} runs; shown: {which} (--all lists "
                          "them, --run ID shows one)", highlight=False)
        render_summary(summary, console)
        if config:
            console.print("config (RUN_DIR/config.json): " + ", ".join(
                f"{k}={v}" for k, v in config.items() if v not in (None, False, [], {})),
                highlight=False)
        if written:
            console.print(f"timeline: {written}", highlight=False)
    return 0


def _report_runs(runs: list[list[dict[str, Any]]], warnings: list[str], *, json: bool) -> int:
    """``planaria report --all``: one row (or JSON summary) per run of the log, oldest first."""
    summaries = [summarize(r) for r in runs]
    if json:
        sys.stdout.write(_json.dumps([s.to_json() for s in summaries], default=str) + "\n")
        sys.stdout.flush()
        return 0
    table = Table(title=f"{len(runs)} runs (planaria report RUN_DIR --run ID shows one)")
    for col in ("run", "started", "status", "segments", "steps", "wall", "goodput"):
        table.add_column(col, justify="left" if col in ("run", "started", "status") else "right")
    for s in summaries:
        steps = s.steps
        done = f"{steps.get('committed', 0)}" + (f" / {steps['target']}"
                                                 if steps.get("target") else "")
        started = ("-" if s.start_t is None
                   else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.start_t)))
        table.add_row(str(s.run_id or "?"), started, s.status, str(s.segments), done,
                      _s(s.wall_s), _pct(s.goodput))
    console = Console()
    console.print(table)
    for warning in warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
    return 0


def _resolved_config(run_dir: Path) -> dict[str, Any] | None:
    """The options ``planaria run`` resolved (``RUN_DIR/config.json``), if it wrote them."""
    path = run_dir / "config.json"
    try:
        loaded = _json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None
