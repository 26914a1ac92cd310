"""Regenerates BENCHMARKS.md from the benchmark scripts' JSON outputs.

    python bench/make_benchmarks_md.py                     # from the saved bench/results/*.json
    python bench/make_benchmarks_md.py --run               # run every bench script first
    python bench/make_benchmarks_md.py --run --only overhead
    python bench/make_benchmarks_md.py --ingest overhead=/tmp/overhead.out
    python bench/make_benchmarks_md.py --rescore           # figures again from results/raw

Each bench script (``bench/overhead.py``, ``bench/recovery.py``, ``bench/goodput.py``
and, when it exists, ``bench/checkpoint.py``) prints one JSON object as its last line.
``--run`` runs a script and saves that object to ``bench/results/NAME.json``
with the command, the date, the machine and the load average around the run;
``--ingest NAME=PATH`` saves the last line of an output captured earlier (the
command recorded is ``python bench/NAME.py``, or ``--command``);
``--ingest NAME=A,B,C`` takes several runs' outputs and saves the run with the
median figure (``MEDIAN_OF``), the others' figures beside it. BENCHMARKS.md
is then written from every saved result; a section whose result was measured at another
commit than this checkout's is marked "from <commit>". ``--rescore`` recomputes the
goodput and recovery results from their raw per-run records (``bench/results/raw``,
``bench/records.py``) without running anything.
"""

from __future__ import annotations

import argparse
import json
import operator
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))  # for bench.common, when run as a script

from bench import common, records, stats  # noqa: E402
from bench.records import machine  # noqa: E402

RESULTS = _REPO / "bench" / "results"
BENCHES = ("overhead", "overhead_before", "recovery", "recovery-torchft-hb50",
           "goodput-realistic", "goodput-fast",
           "goodput", "checkpoint", "checkpoint-copy-at-save", "spares",
           "overlap", "warm_join", "joiner_priority", "joiner_route", "sharded", "campaign",
           "campaign_widened", "dispatch", "sim_validation", "gpu")
MEDIAN_OF = {"sharded": "ratio", "overhead": "ratio", "overhead_before": "ratio",
             "goodput": "goodput_vs_torchft", "dispatch": "growth_last_over_first",
             "sim_validation": "max_error_pp"}
"""``--ingest NAME=A,B,C``: the figure whose median run is NAME's result (the others are kept
under ``repeats``)."""
GOODPUT_TARGETS = (
    ("planaria with a spare, goodput", "planaria_spares.goodput", ".3f", "≥", None),
    ("÷ torchft's best", "goodput_vs_torchft", ".3f", ">", 1),
    ("÷ torchrun's best", "goodput_vs_torchrun", ".3f", ">", 1),
    ("planaria with a spare, full width p50 (s)", "planaria_spares.full_width_s_p50", ".2f",
     "≤", 1),
    ("planaria with a spare, full width p99 (s)", "planaria_spares.full_width_s_p99", ".2f",
     "≤", 1),
)
"""The goodput bench's targets: label, figure, format, comparison, bound (None: the record's
own ``targets.goodput_spares_min``)."""
COMPARE = {"≥": operator.ge, ">": operator.gt, "≤": operator.le}
OVERHEAD_FIGURES = (
    ("`small` step, median (ms)", "planaria_step_ms", "ddp_step_ms", "ratio"),
    ("`small` step, mean (ms)", "planaria_step_ms_mean", "ddp_step_ms_mean", "ratio_of_means"),
    ("`small`, one step at a time (ms)", "train_step_ms|per_step_protocol_step_ms", None,
     "train_step_ratio|per_step_protocol_ratio"),
    ("`small`, controller overhead of a step (ms)", "controller_overhead_ms", None, None),
    ("`tiny` step, median (ms)", "tiny.planaria_step_ms", "tiny.ddp_step_ms", "tiny.ratio"),
    ("`tiny` step, mean (ms)", "tiny.planaria_step_ms_mean", "tiny.ddp_step_ms_mean",
     "tiny.ratio_of_means"),
    ("`tiny`, one step at a time (ms)", "tiny.train_step_ms|tiny.per_step_protocol_step_ms",
     None, "tiny.train_step_ratio|tiny.per_step_protocol_ratio"),
    ("`tiny`, controller overhead of a step (ms)", "tiny.controller_ms", None, None),
)
"""The overhead bench's figures compared before and after a change: label, planaria's,
DDP's, the ratio (``a|b``: the first that the record has; a record from before the one
step protocol names one step at a time ``per_step_protocol_*``)."""
TARGET_FIGURES = {
    "goodput": tuple(path for _, path, *_ in GOODPUT_TARGETS),
    **{name: tuple(p for row in OVERHEAD_FIGURES for f in row[1:] if f for p in f.split("|"))
       for name in ("overhead", "overhead_before")},
}
"""``--ingest NAME=A,B,C``: the figures a target is set on, each kept with its own median over
the runs under ``medians`` (the median run by one figure need not be the median of another)."""


def _figure(result: dict[str, Any], path: str) -> Any:
    """``result``'s value at a dotted ``path`` (``planaria_spares.goodput``), None if absent."""
    value: Any = result
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def medians(results: list[dict[str, Any]], paths: tuple[str, ...]) -> dict[str, Any]:
    """Each figure at ``paths``: its value in every run and their median (of the runs that
    have it)."""
    out: dict[str, Any] = {}
    for path in paths:
        runs = [_figure(r, path) for r in results]
        values = sorted(v for v in runs if isinstance(v, (int, float)))
        if values:
            out[path] = {"runs": runs, "median": statistics.median(values)}
    return out


def last_json(text: str) -> dict[str, Any]:
    """The JSON object on the last non-empty line of a bench script's output."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError("empty output")
    return json.loads(lines[-1])


def commit() -> str | None:
    """The checkout's commit (``-dirty`` when tracked files differ from it), or None outside
    a git checkout: every result records what it measured."""
    return records.tree_commit(_REPO)


def save(
    name: str, result: dict[str, Any], command: str, *, when: float | None = None,
    machine_info: dict[str, Any] | None = None, path: Path | None = None, **extra: Any
) -> Path:
    """Writes a bench's record (to ``bench/results/<name>.json`` unless ``path`` is given)."""
    return records.save_record(path or RESULTS / f"{name}.json", name, result, command,
                               when=when, machine_info=machine_info, **extra)


SAVES_ITS_OWN = ("goodput",)
"""Scripts that write their own summary record (``results/goodput-<regime>.json``, with the
raw records it came from): ``--run`` runs them and saves nothing more."""


def run(name: str, extra_args: list[str], timeout_s: float) -> Path | None:
    script = _REPO / "bench" / f"{name}.py"
    cmd = [sys.executable, str(script), *extra_args]
    shown = " ".join(["python", f"bench/{name}.py", *extra_args])
    before, t0 = common.loadavg(), time.time()
    print(f"running: {shown}", flush=True)
    proc = subprocess.run(cmd, cwd=_REPO, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise RuntimeError(f"{shown} exited with {proc.returncode}")
    print(proc.stdout, flush=True)
    if name in SAVES_ITS_OWN:
        return None
    return save(
        name,
        last_json(proc.stdout),
        shown,
        loadavg_before=before,
        loadavg_after=common.loadavg(),
        wall_s=round(time.time() - t0, 1),
        table=_table_lines(proc.stdout),
    )


def _table_lines(text: str) -> list[str]:
    """The human-readable part of the output (everything but the JSON line, and Ray's own
    notices: its log lines carry a ``(raylet)``-style prefix)."""
    lines = [line for line in text.splitlines() if line.strip()]
    return [line for line in lines[:-1]
            if "Token authentication" not in line and "(raylet)" not in line]


def load_results() -> dict[str, dict[str, Any]]:
    return {
        p.stem: json.loads(p.read_text())
        for p in sorted(RESULTS.glob("*.json"))
        if p.stem in BENCHES or p.stem == "gpu_tests" or p.stem.startswith(_TAGGED)
    }


_TAGGED = ("goodput-", "recovery-")
"""Results saved under a tag of their own (``goodput-<regime>-<tag>``, ``recovery-<tag>``:
another sitting, another commit), each a section beside its bench's own."""


def _order(results: dict[str, dict[str, Any]]) -> list[str]:
    """BENCHES' order, each tagged result (``goodput-<regime>``, other kill rates too, or
    ``recovery-<tag>``) beside its bench's own."""
    extra = sorted(n for n in results if n.startswith(_TAGGED) and n not in BENCHES)
    out: list[str] = []
    for name in BENCHES:
        out.append(name)
        out += [n for n in extra if n.startswith(name + "-") and n not in out]
    return out


# ---------------------------------------------------------------- rendering


def _f(x: Any, spec: str = ".2f") -> str:
    if x is None:
        return "—"
    if isinstance(x, (int, float)):
        return format(x, spec)
    return str(x)


def _within(value: float | None, ci: Any, bound: float) -> bool | None:
    """A "<= bound" target is met only where the 95 % interval's upper end is within it
    (the point estimate where no interval was measured)."""
    if value is None:
        return None
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and ci[1] is not None:
        return float(ci[1]) <= bound
    return value <= bound


def _ok(met: bool | None) -> str:
    return "—" if met is None else ("met" if met else "**missed**")


def _ahead(ratio: dict[str, Any] | None) -> str:
    """A ratio's claim: "met (ahead)", "**missed** (ahead)", or "—" where none is made."""
    ahead = (ratio or {}).get("ahead")
    return "—" if ahead is None else f"{_ok(ahead)} (ahead)"


def _commits(commit: Any) -> str:
    """A record's commit, or the commits of a result scored from runs at several
    (12 hex digits each, ``-dirty`` kept: a run from a dirty tree is not its commit's)."""
    if isinstance(commit, list):
        return ", ".join(records.commit_dir_name(str(c)) for c in commit)
    return records.commit_dir_name(str(commit)) if commit else ""


def _header(rec: dict[str, Any]) -> list[str]:
    lines = [f"Command: `{rec['command']}` — {rec['date']}"
             + (f", commit `{_commits(rec['commit'])}`" if rec.get("commit") else "")]
    load = rec["result"].get("loadavg") or {}
    before = rec.get("loadavg_before") or load.get("before")
    after = rec.get("loadavg_after") or load.get("after")
    if before or after:
        lines.append(f"Load average (1/5/15 min) before: {before}; after: {after}.")
    m = rec.get("machine") or {}
    if m.get("cpu"):  # the machines differ between sections: each names its own
        lines.append(f"Machine: {m.get('nproc')} CPUs ({m['cpu']}), {m.get('mem_gib')} GiB.")
    return lines


def _ci(pair: list[float] | None, fmt: str) -> str:
    return "" if not pair else f" ({_f(pair[0], fmt)} to {_f(pair[1], fmt)})"


def _runs(r: dict[str, Any], what: str = "") -> str:
    """The sentence naming the runs a result was taken from (ingested from several)."""
    repeats = r.get("repeats")
    if not repeats:
        return " One run."
    return (f" The median run of {len(repeats)}{what} "
            f"({', '.join(_f(x, '.3f') for x in repeats)}).")


def _one_step(r: dict[str, Any]) -> tuple[Any, Any, str]:
    """One step at a time: ``train_step_ms`` (a run of one step), or in a record from before
    the one protocol, the per-step protocol's."""
    if r.get("train_step_ms") is not None:
        return r["train_step_ms"], r.get("train_step_ratio"), "one step at a time (`train_step`)"
    return (r.get("per_step_protocol_step_ms"), r.get("per_step_protocol_ratio"),
            "the same, per-step protocol")


def _median_of(rec: dict[str, Any], paths: str | None) -> Any:
    """The median over a record's runs of the first of ``paths`` (``a|b``) it has."""
    for path in (paths or "").split("|"):
        m = (rec["result"].get("medians") or {}).get(path)
        if m is not None:
            return m["median"]
    return None


def render_overhead_change(before: dict[str, Any], after: dict[str, Any] | None) -> list[str]:
    """The overhead bench before and after a change, on one machine: each figure's median
    over each side's runs."""
    if after is None:
        return []
    nb = len(before["result"].get("repeats") or [1])
    na = len(after["result"].get("repeats") or [1])
    out = ["## Overhead before and after the one step protocol", "",
           f"`{before['command']}` at `{str(before.get('commit'))[:7]}` ({nb} runs, "
           f"{before.get('date')}) and at `{str(after.get('commit'))[:7]}` ({na} runs, "
           f"{after.get('date')}), one after the other on the same idle machine; each cell is "
           "the median over the runs of that run's figure (pooled medians over its rounds). "
           "Before, one step at a time was the per-step protocol (one call per worker per "
           "step); after, it is `Job.train_step`, a run of one step. The DDP baseline loads "
           "the next step as planaria does in both.", "",
           "| figure | planaria before | planaria after | DDP before | DDP after | "
           "ratio before | ratio after |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, pl, ddp, ratio in OVERHEAD_FIGURES:
        cells = [_median_of(before, pl), _median_of(after, pl), _median_of(before, ddp),
                 _median_of(after, ddp), _median_of(before, ratio), _median_of(after, ratio)]
        fmt = [".2f", ".2f", ".2f", ".2f", ".3f", ".3f"]
        out.append(f"| {label} | " + " | ".join(
            "—" if c is None else _f(c, f) for c, f in zip(cells, fmt, strict=True)) + " |")
    return [*out, ""]


AB_FIGURES = (("planaria ÷ DDP, `{size}` (median of a run's steps)", "ratio", ".3f"),
              ("planaria ÷ DDP, `{size}` (ratio of means)", "ratio_of_means", ".3f"),
              ("planaria ÷ DDP, `tiny`", "tiny_ratio", ".3f"),
              ("planaria's step, `{size}` (ms)", "planaria_step_ms", ".1f"),
              ("DDP's step, `{size}` (ms)", "ddp_step_ms", ".1f"),
              ("one step's latency, `Job.train_step` (ms)", "train_step_ms", ".1f"))


def render_overhead_ab(records: list[dict[str, Any]]) -> list[str]:
    """``bench/overhead_ab.py``'s records: two commits' overhead runs alternating, each
    figure's median per commit and B - A with its bootstrapped 95% interval."""
    if not records:
        return []
    out = ["## Overhead at two commits, side by side (`bench/overhead_ab.py`)", "",
           "Each record runs `bench/overhead.py --rounds 1` at commits A and B, alternating, "
           "for its pairs (records with an `order` alternate the pairs' order too: AB, BA, "
           "...); a run's figure is one observation. Estimator (chosen "
           "before the runs): each commit's median, and B - A with a 95% interval "
           "bootstrapped over the pairs. B is shown slower only where the whole interval "
           "is above 0.", ""]
    for rec in records:
        out += [f"`{rec.get('command')}`: A `{rec['a']}`, B `{rec['b']}`, {rec['pairs']} "
                f"pairs, {rec.get('date', 'n/a')}, {rec.get('machine', '')}", "",
                "| figure | A | B | B - A | 95% interval |", "|---|---:|---:|---:|---|"]
        runs = (rec.get("runs") or {}).get("a") or [{}]
        size = runs[0].get("size", "small")
        invalid = set(rec.get("invalid_figures") or ())
        for label, key, fmt in AB_FIGURES:
            f = rec.get(key)
            if not f or key in invalid:  # a record's own note says why (below)
                continue
            label = label.format(size=size)
            lo, hi = f["b_minus_a_ci95"]
            out.append(f"| {label} | {_f(f['a_median'], fmt)} | {_f(f['b_median'], fmt)} | "
                       f"{f['b_minus_a']:+{fmt}} | {lo:+{fmt}} to {hi:+{fmt}} |")
        out.append("")
        if rec.get("note"):
            out += [f"Note: {rec['note']}", ""]
    return out


def render_overhead(rec: dict[str, Any]) -> list[str]:
    r = rec["result"]
    b = r.get("breakdown_ms") or {}
    ratio = r.get("ratio")
    out = ["## Steady-state overhead: planaria vs DDP", "", *_header(rec), ""]
    paragraph = len(out)
    out += [
        f"Model `{r.get('size')}`, {r.get('replicas')} replicas x {r.get('threads')} torch "
        f"thread, global batch {r.get('global_batch', 48)} "
        f"(micro-batch {r.get('micro_batch', 8)}), {r.get('steps')} steps per run with "
        f"{r.get('warmup')} warm-up steps left out, {len(r.get('rounds') or [])} interleaved "
        + ("rounds (planaria, DDP, ...; one step at a time too in the first "
           f"{r['train_step_rounds']}); medians over every steady step, 95% intervals "
           "bootstrapped over the rounds." if "train_step_rounds" in r else
           "rounds (planaria, DDP, ...; the per-step protocol too in the first "
           f"{r['per_step_rounds']}); medians over every steady step, 95% intervals "
           "bootstrapped over the rounds." if "per_step_rounds" in r else
           "rounds (planaria, planaria per step, DDP, ...); medians over every steady step.")
        + (f" DDP loads the next step as planaria's worker does (`--prefetch "
           f"{r['ddp_prefetch']}`)." if r.get("ddp_prefetch") else "")
        + (f" The `tiny` cross-check: {r['tiny_steps']} steps per run, {r['tiny_warmup']} "
           "warm-up, as many rounds." if r.get("tiny_steps") else ""),
        "",
        "| | planaria | DDP (torchrun) | ratio (95% interval) | fixed ms a step | target |",
        "|---|---:|---:|---:|---:|---|",
        f"| median step time (ms), `{r.get('size')}` model | {_f(r['planaria_step_ms'], '.2f')} "
        f"| {_f(r['ddp_step_ms'], '.2f')} | {_f(ratio, '.3f')}{_ci(r.get('ratio_ci95'), '.3f')} "
        f"| {_f(r.get('fixed_ms'), '+.2f')}{_ci(r.get('fixed_ms_ci95'), '+.2f')} | ≤ 1.03: "
        f"{_ok(_within(ratio, r.get('ratio_ci95'), 1.03))} |",
    ]
    if r.get("repeats"):
        out[paragraph] += _runs(r, ", by the small model's ratio")
    one_ms, one_ratio, one_label = _one_step(r)
    if one_ms is not None:
        out.append(
            f"| {one_label} | {_f(one_ms, '.2f')} | "
            f"{_f(r['ddp_step_ms'], '.2f')} | {_f(one_ratio, '.3f')} | — "
            "| — |"
        )
    if r.get("planaria_step_ms_mean") is not None:
        out.append(
            f"| mean step time (ms), `{r.get('size')}` model | "
            f"{_f(r['planaria_step_ms_mean'], '.2f')} | {_f(r['ddp_step_ms_mean'], '.2f')} | "
            f"{_f(r.get('ratio_of_means'), '.3f')} | — | — |"
        )
    tiny = r.get("tiny")
    if tiny:
        tr = tiny.get("ratio")
        out.append(
            f"| `tiny` model (ms) | {_f(tiny['planaria_step_ms'], '.2f')} | "
            f"{_f(tiny['ddp_step_ms'], '.2f')} | {_f(tr, '.3f')}"
            f"{_ci(tiny.get('ratio_ci95'), '.3f')} | {_f(tiny.get('fixed_ms'), '+.2f')}"
            f"{_ci(tiny.get('fixed_ms_ci95'), '+.2f')} | ≤ 1.15: "
            f"{_ok(_within(tr, tiny.get('ratio_ci95'), 1.15))} |"
        )
        t_ms, t_ratio, t_label = _one_step(tiny)
        if t_ms is not None:
            out.append(
                f"| {t_label} | {_f(t_ms, '.2f')}"
                f" | {_f(tiny['ddp_step_ms'], '.2f')} | "
                f"{_f(t_ratio, '.3f')} | — | — |"
            )
        if tiny.get("planaria_step_ms_mean") is not None:
            out.append(
                f"| `tiny` mean step time (ms) | {_f(tiny['planaria_step_ms_mean'], '.2f')} | "
                f"{_f(tiny['ddp_step_ms_mean'], '.2f')} | {_f(tiny.get('ratio_of_means'), '.3f')}"
                " | — | — |"
            )
    out += ["", "planaria's step time is `fit`'s (runs up to the next boundary): the period "
            "between rank 0's commits in a run of the steady steps. The breakdown below is "
            + ("one step's at a time (`Job.train_step`, a run of one step)."
               if "train_step_ms" in r else "the per-step protocol's (one call per worker per "
               "step).")]
    out += [
        "",
        "Where planaria's step goes (medians per step):",
        "",
        f"- slowest worker's own data wait + compute + reduce: {_f(b.get('worker_ms'), '.1f')} ms",
        f"- step wall time minus that: {_f(b.get('gap_ms'), '.1f')} ms, of which one Adam "
        "update (applied by the worker outside its timers; measured): "
        f"{_f(b.get('apply_ms'), '.1f')} ms",
        f"- **controller overhead: {_f(r['controller_overhead_ms'], '.1f')} ms per step** "
        "(Ray dispatch and return, (de)serialisation, step boundary, event log), of which "
        f"Ray transport {_f(b.get('transport_ms'), '.1f')} ms (dispatch → results back, minus "
        "the slowest worker's whole call) and controller bookkeeping "
        f"{_f(b.get('bookkeeping_ms'), '.1f')} ms (step boundary, loss, event log)",
        "",
    ]
    rounds = r.get("rounds") or []
    if rounds:
        out += [
            "| round | planaria ms | DDP ms | slowest worker ms | gap ms |",
            "|---:|---:|---:|---:|---:|",
        ]
        for i, rr in enumerate(rounds):
            out.append(
                f"| {i} | {_f(rr['planaria_step_ms'], '.1f')} | {_f(rr['ddp_step_ms'], '.1f')} | "
                f"{_f(rr.get('worker_ms'), '.1f')} | {_f(rr.get('gap_ms'), '.1f')} |"
            )
        out.append("")
    return out


def _lower_end(value: float | None, ci: Any, bound: float, *, strict: bool = False
               ) -> bool | None:
    """A ">= bound" claim holds only where the interval's low end does; none is made (None)
    where no interval was measured: a point estimate alone supports no claim."""
    if value is None or not (isinstance(ci, (list, tuple)) and len(ci) == 2):
        return None
    low = float(ci[0])
    return low > bound if strict else low >= bound


def _torchft_which(config: dict[str, Any]) -> str:
    """How a torchft configuration a result ran relates to the goodput sweep's pick."""
    try:
        best = json.loads((RESULTS / "torchft_best.json").read_text())["config"]
    except (OSError, ValueError, KeyError):
        return "no sweep result to compare with"
    if best == config:
        return "the goodput sweep's best configuration"
    return (f"given to the run, not the goodput sweep's pick `{json.dumps(best)}`, which came "
            "from one noisy window per configuration"
            + ("; a shorter heartbeat: torchft's faster single-kill recovery"
               if config.get("heartbeat_ms", 0) < best.get("heartbeat_ms", 0) else ""))


def render_recovery(rec: dict[str, Any], tag: str = "") -> list[str]:
    """``tag``: a tagged result's (``recovery-<tag>``), in the title."""
    r = rec["result"]
    pl, tr, ft = r["planaria"], r["torchrun"], r["torchft"]
    s_tr, s_ft = r.get("speedup_vs_torchrun"), r.get("speedup_vs_torchft")
    gbps = pl.get("transfer_gb_per_s")
    lost = pl.get("lost_work_per_kill_steps")
    ft_cfg = ft.get("config") or {}
    title = "## Recovery from one SIGKILL: planaria vs torchrun vs torchft" + (
        f" (torchft at a {ft_cfg['heartbeat_ms']} ms heartbeat)" if ft_cfg else "") + (
        f", {tag}" if tag else "")
    out = [title, "", *_header(rec), ""]
    out += [
        f"Model `{r.get('size')}`, {r.get('replicas')} replicas x 1 thread, {r.get('steps')} "
        f"steps, one worker SIGKILLed in step {r.get('kill_at_step')} (+0-2 by seed). planaria: "
        "resize policy, the kill sent by its chaos plan a third of a typical step into the step, "
        "replacement hot-joins; torchrun: DDP, checkpoint every "
        f"{tr.get('ckpt_every')} steps, `--max-restarts`; torchft: replica groups + lighthouse "
        + (f"at `{json.dumps(ft['config'])}` ({_torchft_which(ft['config'])}; applied: "
           f"{', '.join(ft.get('config_applied') or []) or 'all'}), its victim killing itself "
           "at the same point of the step as planaria's (from commit 9203806 on; before, when "
           "the runner's poll saw the step committed, which could land after the victim's "
           "all-reduce and leave the kill's cost to the next step). " if ft.get("config") else
           f"at a {ft.get('heartbeat_ms', 1000)} ms heartbeat with a synchronous quorum (not its "
           "best configuration: measured side by side and interleaved, torchft was back in "
           "0.35 s at a 250 ms heartbeat and 0.17 s at 100 ms, planaria in 0.15 s; the peers "
           "are to be swept before a ratio against torchft is claimed). ")
        + f"{r.get('repeat', 1)} kill run(s) per system, interleaved; the table shows each "
        "system's median run (by back_s); every run's back_s below."
        + (" Speed-ups: the median of the per-repeat ratios with the paired bootstrap 95 % "
           "interval; ahead only where its low end is above 1." if "speedup_vs_torchft_ci95"
           in r else ""),
        "",
        "| system | step ms | recover_s | back_s | lost_steps |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, x in (("planaria", pl), ("torchrun", tr), ("torchft", ft)):
        out.append(
            f"| {name} | {_f(x.get('step_ms'), '.0f')} | {_f(x['recover_s'])} | "
            f"{_f(x['back_s'])} | {x['lost_steps']} |"
        )
    nbytes = pl.get("transfer_bytes")
    out += [""] + [
        f"- {name} back_s of every run: "
        + ", ".join(_f(v) for v in x.get("back_s_all") or [x["back_s"]])
        for name, x in (("planaria", pl), ("torchrun", tr), ("torchft", ft))
    ]
    out += [
        "",
        "| figure | value | target |",
        "|---|---:|---|",
        f"| back_s speed-up vs torchrun | {_f(s_tr, '.1f')}x"
        f"{_ci(r.get('speedup_vs_torchrun_ci95'), '.2f')} | ≥ 10x: "
        f"{_ok(_lower_end(s_tr, r.get('speedup_vs_torchrun_ci95'), 10))} |",
        f"| back_s speed-up vs torchft | {_f(s_ft, '.2f')}x"
        f"{_ci(r.get('speedup_vs_torchft_ci95'), '.2f')} | ahead (> 1): "
        f"{_ok(_lower_end(s_ft, r.get('speedup_vs_torchft_ci95'), 1, strict=True))} |",
        f"| planaria lost work per kill (steps) | "
        f"{_f(pl.get('lost_work_per_kill_steps'), '.3f')} | ≤ 1/R: "
        f"{_ok(None if lost is None or not r.get('replicas') else lost <= 1 / r['replicas'])} |",
        f"| planaria lost_steps | {pl['lost_steps']} | 0: {_ok(pl['lost_steps'] == 0)} |",
        f"| planaria detect_s | {_f(pl.get('detect_s'), '.3f')} | — |",
        f"| planaria replacement start (requested → ready) | {_f(pl.get('replacement_s'))} s | — |",
        f"| planaria join_s (ready → first commit with it) | {_f(pl.get('join_s'))} s | — |",
        f"| planaria state transfer (`{pl.get('transfer_size')}`, "
        f"{_f(None if nbytes is None else nbytes / 1e6, '.0f')} MB) | {_f(gbps)} GB/s | "
        f"≥ 1 GB/s: {_ok(None if gbps is None else gbps >= 1)} |",
        "",
    ]
    if tr.get("phases_s"):
        ph = tr["phases_s"]
        out += [
            "torchrun's restart, kill → restarted workers ready: "
            + ", ".join(f"{k} {_f(v)} s" for k, v in ph.items())
            + ".",
            "",
        ]
    sc = r.get("scaling")
    if sc:
        out += [
            f"planaria's recovery against state size ({sc['replicas_for_sizes']} replicas) and "
            f"replica count (`{sc['size_for_replicas']}`"
            + (f", micro-batches of {sc['micro_batch_for_replicas']} so that every rank gets one"
               if sc.get("micro_batch_for_replicas") else "")
            + f"): a kill at step {sc['kill_at_step']} of "
            f"{sc['steps']}; back at full width = kill → first commit at the width before it "
            "(the replacement started, received the state and stepped). Above "
            f"{sc['cores']} replicas they share this machine's cores (oversubscribed).",
            "",
            "| model, replicas | state sent (MB) | transfer GB/s | replacement ready (s) | "
            "back at full width (s) |",
            "|---|---:|---:|---:|---:|",
        ]
        rows = [(f"`{k}`, {sc['replicas_for_sizes']}", v) for k, v in sc["by_size"].items()]
        rows += [(f"`{sc['size_for_replicas']}`, {k}" + (" (oversubscribed)"
                  if v.get("oversubscribed") else ""), v) for k, v in sc["by_replicas"].items()]
        for label, v in rows:
            mb = None if v.get("transfer_bytes") is None else v["transfer_bytes"] / 1e6
            out.append(f"| {label} | {_f(mb, '.1f')} | {_f(v.get('transfer_gb_per_s'))} | "
                       f"{_f(v.get('replacement_s'))} | {_f(v.get('full_width_s'))} |")
        out.append("")
    return out


def _est(e: dict[str, Any] | None, fmt: str = ".3f") -> str:
    """An estimate ``{"median", "ci95"}`` as ``median (lo to hi)``."""
    if not e or e.get("median") is None:
        return "n/a"
    ci = e.get("ci95")
    return (f"{e['median']:{fmt}}" + (f" ({ci[0]:{fmt}} to {ci[1]:{fmt}})" if ci else ""))


def render_checkpoint(rec: dict[str, Any]) -> list[str]:
    r = rec["result"]
    if "planaria" not in r:
        return render_generic("checkpoint", rec)
    pl, dcp, ratios, met = r["planaria"], r["dcp"], r["ratios"], r.get("targets", {})
    beside = r.get("planaria_copy_beside")
    title = "## Checkpoint: planaria vs DCP async_save, like for like"
    if beside is False:
        title += " (planaria copying inside the save call)"
    copy = {True: "planaria's copy into staging runs beside the next step, which waits at the "
                  "state's copy fence only if it updates the state before the copy is done "
                  "(the wait is counted in its blocking)",
            False: "planaria's copy into staging runs inside the save call "
                   "(`copy_beside=False`, as before the copy fence)",
            None: ""}[beside]
    out = [
        title, "", *_header(rec), "",
        f"State {r['state_bytes'] / 1e6:.0f} MB (`{r['size']}`: parameters and Adam's "
        f"moments), {r['replicas']} worker processes on each side, one thread each, on "
        f"{r.get('cpus')} cores; a save every {r['every']} steps, {r['saves_per_run']} per "
        f"run, {r['repeat']} repeats, each a run with saves and one without per system (order "
        "alternating). planaria: its job's workers each snapshot and write their byte-balanced "
        "share" + (f" ({copy})" if copy else "") + "; DCP: `async_save` on every rank of a gloo "
        "group, its options swept "
        f"({', '.join(dcp.get('sweep', {}))}), the best by median extra wall "
        f"(`{dcp['config']}`, chosen on the same repeats: a choice that can only favour DCP). "
        "Medians over the repeats with bootstrap 95 % intervals; a ratio is the median of the "
        "per-repeat ratios with the paired bootstrap interval (`bench/stats.py`).", "",
        "| figure | planaria | DCP | ratio | target |", "|---|---:|---:|---:|---|",
        f"| extra wall per save (s) | {_est(pl['extra_wall_per_save_s'])} | "
        f"{_est(dcp['extra_wall_per_save_s'])} | DCP / planaria "
        f"{_est(ratios['extra_wall_dcp_over_planaria'], '.2f')} | low end > 1: "
        f"{_ok(met.get('extra_wall_le_dcp'))} |",
        f"| training blocked per save (s) | {_est(pl['blocking_per_save_s'])} | "
        f"{_est(dcp['blocking_per_save_s'])} | planaria / memcpy "
        f"{_est(ratios['planaria_blocking_over_memcpy'], '.2f')} | high end ≤ 1.5: "
        f"{_ok(met.get('blocking_le_1_5_memcpy'))} |",
        f"| of planaria's, its slowest worker's copy into staging (s) | "
        f"{_est(pl.get('copy_per_save_s'))} | | | |",
        f"| one memcpy of a worker's share, alone (s) | {_est(r.get('memcpy_share_s'), '.4f')} "
        "| | | |",
        *_restore_rows(pl, dcp, met),
        "",
        "| DCP option | extra wall per save (s) | blocked per save (s) |", "|---|---:|---:|",
        *[f"| `{name}` | {_est(v['extra_wall_per_save_s'])} | "
          f"{_est(v['blocking_per_save_s'])} |" for name, v in dcp.get("sweep", {}).items()],
        "",
        f"Cold reads by `{r.get('cold_method')}`; planaria saves dropped (a writer still "
        f"busy): {r.get('planaria_saves_dropped')}. What the blocking is made of and why "
        "the extra wall needs more repeats: docs/design.md (checkpoints, measured).",
    ]
    if r.get("page_cache_dropped") is False:
        out += ["", "The cold raw read was not slower than the warm one: this machine's "
                "storage served it from a host cache, so the cold figures are warm ones."]
    return [*out, ""]


def _restore_rows(pl: dict[str, Any], dcp: dict[str, Any], met: dict[str, Any]) -> list[str]:
    """The restore rows: against the plain reads of the same bytes at the restore's
    parallelism (every replica reading everything, bracketing the restore), and, where the
    record has it, against one read of the checkpoint (the figure before the bracketing)."""
    readers = "every replica reading everything" if "restore_vs_one_read" in pl else "one read"
    rows = [f"| cold restore (s) | {_est(pl['cold_restore_s'])} | "
            f"{_est(dcp['cold_restore_s'])} | | |",
            f"| cold plain reads of the same bytes ({readers}) (s) | "
            f"{_est(pl.get('cold_raw_read_s'))} | {_est(dcp.get('cold_raw_read_s'))} | | |",
            f"| restore vs those reads, cold | {_est(pl['restore_vs_raw'])} | "
            f"{_est(dcp['restore_vs_raw'])} | | planaria's low end ≥ 0.7: "
            f"{_ok(met.get('restore_ge_0_7_raw'))} |"]
    if "restore_vs_one_read" in pl:
        rows += [f"| restore vs one read of the checkpoint, cold | "
                 f"{_est(pl['restore_vs_one_read'])} | {_est(dcp.get('restore_vs_one_read'))} "
                 "| | (R replicas' copies against one) |",
                 f"| planaria's `share` restore vs one read, cold | "
                 f"{_est(pl['share']['restore_vs_raw'])} | | | |"]
    return rows


def _flat(prefix: str, value: Any, out: list[tuple[str, Any]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif not isinstance(value, list):
        out.append((prefix, value))


def render_generic(name: str, rec: dict[str, Any]) -> list[str]:
    rows: list[tuple[str, Any]] = []
    _flat("", {k: v for k, v in rec["result"].items() if k != "bench"}, rows)
    out = [f"## {name.capitalize()}", "", *_header(rec), "", "| figure | value |", "|---|---:|"]
    out += [f"| {k} | {_f(v, '.4g') if isinstance(v, float) else _f(v)} |" for k, v in rows]
    return [*out, ""]


def render_spares(rec: dict[str, Any]) -> list[str]:
    r = rec["result"]
    d = r.get("details", {})
    spare, cold = r.get("full_width_s_spare"), r.get("full_width_s_no_spare")
    out = [
        "## Hot spares", "", *_header(rec), "",
        "Back at full width after a SIGKILL: the kill → the first committed step with every "
        "replica in, with one warm spare and without (a fresh worker starts), side by side; "
        f"the median of {d.get('kills', '?')} kills per run ({d.get('size', '?')} model, "
        f"{d.get('replicas', '?')} replicas).", "",
        "| figure | value | target | met |", "|---|---:|---|:-:|",
        f"| back at full width, with a spare (s) | {_f(spare, '.3f')} | ≤ 1 s "
        f"| {_ok(None if spare is None else spare <= 1.0)} |",
        f"| back at full width, without (s) | {_f(cold, '.3f')} | | |",
        f"| with ÷ without | {_f(r.get('spare_over_no_spare'), '.3f')} | | |",
    ]
    return [*out, ""]


GOODPUT_SYSTEMS = (("planaria, 1 spare", "planaria_spares"), ("planaria, no spare", "planaria"),
                   ("torchft (best)", "torchft"), ("torchrun (best)", "torchrun"))


def _pair(x: dict[str, Any], key: str) -> str:
    return f"{_f(x.get(f'{key}_p50'))} / {_f(x.get(f'{key}_p99'))}"


def render_goodput(rec: dict[str, Any]) -> list[str]:
    """``bench/goodput.py``: goodput under a SIGKILL every ``kill_every_s``, four systems."""
    r = rec["result"]
    ft, tr = r["torchft"], r["torchrun"]
    target = (r.get("targets") or {}).get("goodput_spares_min", 0.95)
    out = [
        "## Goodput under repeated faults", "", *_header(rec), "",
        f"Model `{r.get('size')}`, {r.get('replicas')} replicas x 1 thread on "
        f"{r.get('nproc')} cores (the replicas share them), a window of "
        f"{_f(r.get('duration_s'), '.0f')} s per run with a SIGKILL of a random active worker "
        f"about every {_f(r.get('kill_every_s'), '.0f')} s (seed {r.get('seed')}; the same "
        "schedule and harness for every system, a random point of a step). torchft: async "
        "quorum, replacement started at once, gloo timeout "
        f"{_f(ft.get('pg_timeout_s'))} s, heartbeat timeout swept (best: "
        f"{ft.get('heartbeat_ms')} ms); torchrun: checkpoint interval swept (best: every "
        f"{tr.get('ckpt_every')} steps; Young/Daly: {_f(tr.get('young_daly_ckpt_every'), '.1f')})."
        " Goodput = useful (first-time committed) steps x the system's own fault-free step "
        "time ÷ the window; MTTR = kill → first commit of a step beyond the last one "
        "committed before it; full width = kill → first commit with every replica in "
        "(`bench/goodput.py`'s docstring).", "",
        "| system | goodput | useful steps | lost steps | kills | recoveries | MTTR p50 / p99 (s) "
        "| full width p50 / p99 (s) | step ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, key in GOODPUT_SYSTEMS:
        x = r[key]
        out.append(
            f"| {label} | {_f(x.get('goodput'), '.3f')} | {x.get('useful_steps')} | "
            f"{x.get('lost_steps')} | {x.get('kills')} | {x.get('recoveries')} | "
            f"{_pair(x, 'mttr_s')} | {_pair(x, 'full_width_s')} | {_f(x.get('step_ms'), '.1f')} |"
        )
    for name, x, unit in (("torchft", ft, "heartbeat {} ms"), ("torchrun", tr, "every {} steps")):
        sweep = x.get("sweep") or {}
        if sweep:
            out += ["", f"{name} sweep: " + "; ".join(
                f"{unit.format(k)}: goodput {_f(v.get('goodput'), '.3f')}"
                for k, v in sweep.items()) + "."]
    widths = "; ".join(f"{label}: {r[key].get('step_ms_by_width')}"
                       for label, key in GOODPUT_SYSTEMS)
    out += ["", f"What a missing replica costs here, mean step ms by width: {widths}.", ""]
    runs = r.get("medians") or {}
    if runs:
        n = len(next(iter(runs.values()))["runs"])
        out += [f"The table above is the median run of {n} by `{r.get('repeats_of')}`; each "
                f"figure below is its own median over the {n} runs (each run's value beside "
                "it).", ""]
    out += ["| figure | value | runs | target | met |", "|---|---:|---|---|:-:|"]
    for label, path, fmt, op, bound in GOODPUT_TARGETS:
        bound = target if bound is None else bound
        value = runs[path]["median"] if path in runs else _figure(r, path)
        each = ", ".join(_f(v, fmt) for v in runs[path]["runs"]) if path in runs else "one"
        met = None if value is None else COMPARE[op](value, bound)
        out.append(f"| {label} | {_f(value, fmt)} | {each} | {op} {bound} | {_ok(met)} |")
    out += ["", "Restated after an outside audit: at this regime (23 ms steps, 10 MB of state) "
            "every system is near 1. torchft's gloo timeout (2 s) was not swept, its heartbeat "
            "sweep was best at its edge (250 ms), its replacement starts cold where planaria's "
            "spare forks from a warm server, and the three runs likely drew the same kills; "
            "with a median instead of the per-stretch mean estimator the ratio against torchft "
            "reads about 1.000. So no lead over torchft is claimed from this table; the ratio "
            "against torchrun (interval swept) stands."]
    return [*out, ""]


def render_sim_validation(rec: dict[str, Any]) -> list[str]:
    """``bench/sim_validation.py``: the simulator's goodput for real runs it was not
    calibrated on, against theirs."""
    r = rec["result"]
    cal = ", ".join(f"{system} on `{run}`" for system, run in r["calibrated_on"].items())
    out = [
        "## The simulator out of sample", "", *_header(rec), "",
        f"Calibrated once per system ({cal}); each held-out run's goodput predicted from its "
        "configuration (kill schedule, checkpoint interval, step length) and the "
        f"calibration only. Machine state: {r.get('label')}.{_runs(r)}", "",
        "| held-out run | measured | predicted | error (pp) | target | met |",
        "|---|---:|---:|---:|---|:-:|",
    ]
    for h in r["held_out"]:
        out.append(f"| `{h['run']}` | {_f(h['measured'], '.4f')} | "
                   f"{_f(h['predicted'], '.4f')} | {_f(h['error_pp'], '.2f')} | ≤ 3 "
                   f"| {_ok(h['error_pp'] <= 3.0)} |")
    repeats = r.get("repeats")
    worst = ("" if not repeats else
             f" (the runs' worst: {', '.join(_f(x, '.2f') for x in repeats)})")
    out += ["", f"Worst held-out error {_f(r['max_error_pp'], '.2f')} pp{worst}; every "
            f"held-out run within 3 pp, at least three: {_ok(r['met'])}."]
    return [*out, ""]


def render_warm_join(rec: dict[str, Any]) -> list[str]:
    r = rec["result"]
    ratio = r.get("warm_over_cold")
    out = [
        "## Warm joins of a compiled model", "", *_header(rec), "",
        "A compiled tiny GPT's replacement: asked for → first committed step with it, "
        "compiling from scratch (cold) and from a running worker's compile cache (warm).", "",
        "| figure | value | target | met |", "|---|---:|---|:-:|",
        f"| cold join (s) | {_f(r.get('cold_join_s'), '.2f')} | | |",
        f"| warm join (s) | {_f(r.get('warm_join_s'), '.2f')} | | |",
        f"| warm ÷ cold | {_f(ratio, '.3f')} | ≤ 0.3 "
        f"| {_ok(None if ratio is None else ratio <= 0.3)} |",
    ]
    return [*out, ""]


def render_joiner_priority(rec: dict[str, Any], route: bool = False) -> list[str]:
    """``bench/joiner_priority.py``: a replacement's start, what it costs the survivors;
    ``route``: its state's route compared (by the transfer stall)."""
    r = rec["result"]
    configs = [k for k, v in r.items() if isinstance(v, dict) and "costs" in v]
    if route:
        return render_joiner_route(rec, configs)
    out = [
        "## A replacement's start beside the survivors", "", *_header(rec), "",
        f"`{r.get('size')}` size, 3 replicas, killed at steps {r.get('kills_at')} of each "
        + ("run: a random worker each time." if r.get("victims") == "random" else
           "run: w1, then each time the joiner that came last (from the second kill on, a "
           "dead joiner's memory can go to its replacement).")
        + " Cost per kill: the survivors' steps between the replacement's request and its "
        "join, and the join's step, over the run's fault-free step, summed (configuration: "
        "CPU priority of its setup : optimizer state in a dead joiner's shared memory).", "",
        "| configuration | cost per kill, median (s) | kills | ready after, median (s) "
        "| saved against the first, median (95 % interval) |", "|---|---:|---:|---:|---|",
    ]
    for name in configs:
        c = r[name]
        ready = [x for x in c.get("ready_s", []) if x is not None]
        saved = r.get(f"saved_per_kill_s_{name}")
        out.append(
            f"| {name} | {_f(c['cost_per_kill_s_median'], '.3f')} | {c['kills']} "
            f"| {_f(statistics.median(ready), '.1f') if ready else '-'} "
            f"| {'' if not saved else _f(saved['median'], '.3f') + _ci(saved['ci95'], '.3f')} |")
    return [*out, ""]


def render_joiner_route(rec: dict[str, Any], configs: list[str]) -> list[str]:
    """The route of a joiner's state (``RunConfig.state_by_memory``), by its stall."""
    r = rec["result"]
    out = [
        "## A joiner's state: read out of the source's memory, or over the group", "",
        *_header(rec), "",
        f"`{r.get('size')}` size, 3 replicas on the same cores, killed at steps "
        f"{r.get('kills_at')} of each run (w1, then each time the joiner that came last). "
        "Transfer stall per join: the survivors' wait for the state at the join (beside the "
        "step, the model's part) plus the join's step over the run's fault-free step, as "
        "the goodput bench's floor counts it (configuration: CPU priority of the setup : "
        "shared-memory reserve : route). Estimator chosen before the runs: the median per "
        "route, and the median of the per-join differences paired by round and kill, with "
        "its bootstrap 95 % interval.", "",
        "| configuration | stall per join, median (s) | joins "
        "| saved against the first, median (95 % interval) |", "|---|---:|---:|---|",
    ]
    for name in configs:
        c = r[name]
        saved = r.get(f"stall_saved_per_kill_s_{name}")
        out.append(
            f"| {name} | {_f(c.get('stall_per_kill_s_median'), '.3f')} | {c['kills']} "
            f"| {'' if not saved else _f(saved['median'], '.3f') + _ci(saved['ci95'], '.3f')} |")
    return [*out, ""]


CAMPAIGN_ZERO = ("unrecovered", "diverged", "samples_duplicated", "samples_missing",
                 "healthy_evicted")


def render_sharded(rec: dict[str, Any]) -> list[str]:
    """``bench/sharded.py``: per-worker state against k, the step time against torchrun's
    HSDP on the same 2 x 2 mesh, and one worker's kill."""
    r = rec["result"]
    state = r.get("state_ratio") or {}
    ratio = r.get("ratio")
    lost = (r.get("recovery") or {}).get("lost_steps")
    runs = _runs(r)
    out = [
        "## Sharded replicas", "", *_header(rec), "",
        "2 replicas x 2 workers (FSDP2 inside a replica, planaria's elastic groups across) "
        "against FSDP2 HSDP under torchrun on the same (2, 2) mesh, model, data and batches; "
        "per-worker state (parameters, gradients and optimizer state) at 1 x k." + runs, "",
        "| figure | value | target | met |", "|---|---:|---|:-:|",
    ]
    for k, v in (r.get("state_bytes_per_worker") or {}).items():
        target = {"2": 0.55, "4": 0.3}.get(str(k))
        got = state.get(str(k), state.get(k))
        out.append(f"| state per worker at k = {k} (bytes; ÷ k = 1) | {v:,} "
                   f"({_f(got, '.3f')}) | {'≤ ' + str(target) if target else ''} | "
                   f"{_ok(None if target is None or got is None else got <= target)} |")
    out += [
        f"| planaria step (ms) | {_f(r.get('step_ms'))} | | |",
        f"| torchrun HSDP step (ms) | {_f(r.get('torchrun_hsdp_step_ms'))} | | |",
        f"| ratio | {_f(ratio, '.3f')} | ≤ 1.10 | "
        f"{_ok(None if ratio is None else ratio <= 1.10)} |",
        f"| a worker killed: recover (s) | {_f(r.get('recover_s'), '.2f')} | | |",
        f"| back at full width (s) | {_f(r.get('back_at_full_width_s'), '.2f')} | | |",
        f"| lost steps | {'—' if lost is None else lost} | 0 "
        f"| {_ok(None if lost is None else lost == 0)} |",
    ]
    return [*out, ""]


def render_campaign(rec: dict[str, Any], title: str = "Fault campaign") -> list[str]:
    """``planaria campaign``'s summary, saved with ``--ingest campaign=OUT --command CMD``
    (``campaign_widened``: the widened mix's, which may be a part, ``runs_left`` > 0): its
    counts, every bound's violations and, per kind, the faults injected, ok and failed (a
    summary from before the bounded campaign has neither)."""
    r = rec["result"]
    bounds = r.get("bound_violations") or {}
    zero = (all(r.get(k) == 0 for k in CAMPAIGN_ZERO) and not r.get("processes_left")
            and not any(bounds.values()))
    size = r.get("faults_injected") or 0
    scale = "the target's size" if size >= 1000 else "smaller than the target (a 1,000-fault " \
        "campaign is a half-day run: docs/campaign.md)"
    left = r.get("runs_left") or 0
    if left:
        scale += f"; a part: {left} of its planned runs are still to run (`--record`)"
    out = [f"## {title}", "", *_header(rec), "",
           "Target: 1,000 faults over the whole mix and every step length with 0 unrecovered, "
           "0 diverged, 0 duplicated, 0 missing, 0 healthy evicted, 0 processes left and every "
           "recovery inside its bound (`planaria campaign --faults 1000 --seed 0`). This "
           f"campaign: {size} faults, {scale}; zero counts {'**met**' if zero else '**missed**'}"
           + ("." if "bound_violations" in r else " (a campaign from before the bounded "
              "verdict: its recoveries were not bounded, its reference was a faultless "
              "planaria run)."),
           "", "| figure | value |", "|---|---:|"]
    out += [f"| {k} | {v if isinstance(v, int) else _f(v, '.4g')} |" for k, v in r.items()
            if not isinstance(v, dict)]
    if bounds:
        out += ["", "| bound | violations |", "|---|---:|"]
        out += [f"| `{k}` | {v} |" for k, v in bounds.items()]
    kinds = r.get("kinds") or {}
    if kinds:
        out += ["", "| kind | injected | ok | failed |", "|---|---:|---:|---:|"]
        out += [f"| `{k}` | {c.get('injected')} | {c.get('ok')} | {c.get('failed')} |"
                for k, c in kinds.items()]
    return [*out, ""]


def render_dispatch(rec: dict[str, Any]) -> list[str]:
    """``bench/dispatch.py``: the controller's per-step cost against the worker count, both
    step protocols side by side."""
    r = rec["result"]
    old = r.get("old_per_step_controller_ms", {})
    new = r.get("per_step_controller_ms") or {}
    cores = r.get("oversubscribed_above") or 0
    growth = r.get("growth_last_over_first")
    first = next(iter(new.values()), None) if new else None
    out = ["## Controller cost per step", "", *_header(rec), "",
           "Protocol-only workers (Ray actors that do no training and answer with records of "
           "the real shape), against the number of workers. Per-step protocol: one round of "
           "calls (one per worker, then the wait for every answer), the controller on every "
           "step's critical path. Autonomous loop (`fit`'s): the controller's CPU time "
           "(dispatch, its wait loop and poll, one event-log line per step) for runs of two "
           f"lengths ({r.get('run_lengths')} steps of {_f(r.get('step_ms'), '.0f')} ms): "
           "the slope is the cost of a step, the rest the cost of a run (one call per "
           "worker, at a generation, a checkpoint, a join, the end); the controller is on no "
           f"step's critical path. Above {cores} workers the actors share this machine's "
           f"{cores} cores; every stand-in is started before the first count and the ones a "
           "count does not use idle, so the machine carries the same processes at every "
           "count. " + (
               "Each stand-in loads the controller's store as a real worker does (planaria's "
               f"heartbeat thread every {r['heartbeat_s']:g} s; on rank 0 the stop key's watch "
               "and the stream of records), served in the measured process as in the "
               "controller's. While a run goes on the controller waits on every call through "
               "one completion callback each (`planaria.control.call_watch.CallWatch`) and "
               "reads no "
               "heartbeat while rank 0's stream vouches for the ranks (`Liveness.vouch`)."
               if r.get("heartbeat_s") else
               "The stand-ins did not touch the controller's store (no heartbeats). While a run "
               "went on the controller waited on rank 0's call and swept the others every "
               "second."), "",
           "| workers | per-step protocol (ms/step) | autonomous loop: controller CPU a step "
           "(ms) | and a run (ms) |",
           "|---:|---:|---:|---:|"]
    per_run = r.get("per_run_controller_ms") or {}
    for n, ms in old.items():
        over = " (oversubscribed)" if int(n) > cores else ""
        out.append(f"| {n}{over} | {_f(ms)} | {_f(new.get(n), '.3f') if new else '—'} | "
                   f"{_f(per_run.get(n), '.1f') if per_run else '—'} |")
    if new and growth is not None:
        out += ["", f"Targets (autonomous loop): ≤ 0.5 ms a step at 3 workers: "
                f"{_f(first, '.3f')} ms {_ok(first is not None and first <= 0.5)}; at "
                f"{list(new)[-1]} within 1.5x of at {next(iter(new))}: {_f(growth, '.2f')}x "
                f"{_ok(growth <= 1.5)}." + (_runs(r, ", by that growth") if r.get("repeats")
                                             else "")]
    auto, per = r.get("real_autonomous") or {}, r.get("real_per_step") or {}
    if auto:
        out += ["", "With 3 real workers on the tiny model: step "
                f"{_f(auto.get('step_ms_median'))} ms under the autonomous loop, "
                f"{_f(per.get('step_ms_median'))} ms per step; the controller's CPU "
                f"{_f(auto.get('controller_cpu_ms'), '.3f')} ms a step against "
                f"{_f(per.get('controller_cpu_ms'), '.3f')} ms."]
    if r.get("overhead_ratio_small") is not None:
        out += ["", f"`bench/overhead.py` in the same run ({r.get('overhead_rounds')} "
                "round): step time against DDP "
                f"{_f(r['overhead_ratio_small'], '.3f')}x on the small model, "
                f"{_f(r.get('overhead_ratio_tiny'), '.3f')}x on the tiny one (its own "
                "section has three rounds)."]
    out += ["", "Per-step protocol with 3 real workers on the tiny model: "
            f"{_f(r.get('real_workers_controller_ms'))} ms of a "
            f"{_f(r.get('real_workers_step_ms'))} ms step is the controller's "
            f"({_f(r.get('real_workers_transport_ms'))} ms of it Ray transport).", ""]
    return out


def render_gpu(rec: dict[str, Any], tests: dict[str, Any] | None = None) -> list[str]:
    """``bench/gpu.py``'s figures, from another machine than the rest (its own line), and the
    last run of the GPU tests (``gpu_tests``: pytest's summary, ingested as one JSON line)."""
    r, m = rec["result"], rec["machine"]
    rc = r.get("recovery", {})
    out = ["## On a GPU", "", f"Command: `{rec['command']}` — {rec['date']}.", "",
           f"Machine: {r.get('gpus')} x {r.get('device')}, {m.get('nproc', '?')} CPUs, "
           f"{m.get('mem_gib', '?')} GiB, torch {r.get('torch')}, ray {m.get('ray', '?')}. "
           "With fewer GPUs than ranks the ranks share the device and both planaria and DDP "
           "use gloo (NCCL cannot put two ranks on one GPU): a like-for-like comparison, "
           "not NCCL's speed. `tests/worker/test_gpu.py` runs there too "
           "(`bash bench/gpu_check.sh`; "
           "the NCCL kill test needs two GPUs and skips on one).", "",
           "| model | planaria's driver | planaria step (ms) | DDP step (ms) | ratio | backend "
           "| ≤ 1.05 (autonomous loop) |",
           "|---|---|---:|---:|---:|---|---|"]
    for size, o in r.get("overhead", {}).items():
        auto = o.get("driver") == "run_steps"
        ci = o.get("ratio_ci95")
        ratio = _f(o.get("ratio"), ".3f") + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
        verdict = _ok(o.get("le_1_05")) if auto else "not measured on this driver"
        out.append(f"| {size} | {'autonomous loop' if auto else 'one step at a time'} | "
                   f"{_f(o.get('planaria_step_ms'))} | {_f(o.get('ddp_step_ms'))} "
                   f"| {ratio} | {o.get('backend')} | {verdict} |")
    if any(o.get("driver") != "run_steps" for o in r.get("overhead", {}).values()):
        out += ["", "One step at a time: `Job.train_step`, a controller round trip per step "
                "(what `bench/gpu.py` measured before 2026-12-04). The target is on the "
                "autonomous loop (`fit`'s `Job.run_steps`), which the bench measures now: "
                "re-run `bash bench/gpu_check.sh` on a GPU for its figure."]
    out += ["", f"A worker SIGKILLed mid-run ({rc.get('size')} model, 3 replicas on the GPU, "
            f"{rc.get('backend')}), resize then hot-join:", "",
            "| figure | value |", "|---|---:|"]
    for key in ("recover_s", "back_s", "lost_steps", "detect_s", "replacement_s", "join_s",
                "transfer_bytes", "transfer_s", "transfer_gb_per_s", "step_ms_median",
                "final_width"):
        v = rc.get(key)
        out.append(f"| {key} | {_f(v, '.4g') if isinstance(v, float) else v} |")
    if tests is not None:
        t = tests["result"]
        out += ["", f"The GPU tests, last run {tests['date']} on {t.get('device', 'the GPU')} "
                f"(`{tests['command']}`): **{t.get('summary')}**."]
        out += [f"Skipped: {reason}" for reason in t.get("skipped", [])]
    return [*out, ""]


def stale_mark(rec: dict[str, Any], head: str) -> str | None:
    """The line that marks a section measured at another commit than this checkout's:
    "from <commit>" (None when it is this checkout's, or no commit is known here)."""
    commit_of = rec.get("commit") or ""
    if isinstance(commit_of, list):  # runs at several commits: stale unless all are HEAD
        if not head or all(str(c).removesuffix("-dirty") == head for c in commit_of):
            return None
        return (f"**From commits {_commits(commit_of)}** (this page's checkout: {head[:12]}): "
                "each run at the commit listed below, not re-run since.")
    commit_of = str(commit_of)
    if not head or commit_of.removesuffix("-dirty") == head:
        return None
    return (f"**From {_commits(commit_of) or 'an unrecorded commit'}** (this page's checkout: "
            f"{head[:12]}): measured before the code's latest changes, not re-run since.")


def _est(x: dict[str, Any] | None, fmt: str = ".3f") -> str:
    if not x or x.get("median") is None:
        return "—"
    return f"{_f(x['median'], fmt)}{_ci(x.get('ci95'), fmt)}"


def _runs_by(what: str, groups: dict[str, list[str]]) -> str:
    """``Runs by WHAT: key: run, run; key: run.``"""
    return f"Runs by {what}: " + "; ".join(
        f"{key}: {', '.join(sorted(names))}" for key, names in sorted(groups.items())) + "."


def render_goodput_repeats(rec: dict[str, Any], name: str = "") -> list[str]:
    """``bench/goodput.py --regime R``: medians over repeats, paired ratios, intervals.
    ``name``: the record's file name (``goodput-<regime>[-<tag>]``); a tag beyond the regime
    (another sitting's records of the same regime) goes in the title."""
    r = rec["result"]
    d = r.get("detail") or {}
    setup = d.get("setup") or {}
    pl = r.get("planaria") or {}
    sp = r.get("planaria_spares") or {}
    seeds = d.get("seeds") or {}
    regime = str(r.get("regime"))
    tag = name.removeprefix(f"goodput-{regime}").removeprefix("-")
    title = f"## Goodput under repeated faults, `{regime}` regime" + (f", {tag}" if tag else "")
    out = [title, "", *_header(rec),
           "", f"Model `{setup.get('size')}`, {setup.get('replicas')} replicas, window "
           f"{_f(setup.get('duration_s'), '.0f')} s, a SIGKILL about every "
           f"{_f(setup.get('kill_every_s'), '.0f')} s, {len(d.get('repeats') or [])} repeats "
           f"with kill seeds {', '.join(str(v) for vs in seeds.values() for v in vs)}, "
           + (f"each repeat's window in {setup.get('parts')} parts run in turn, the systems "
              "alternating (A B, B A, ...)" if (setup.get("parts") or 1) != 1
              else "interleaved") + ". Each figure is the median over "
           "the repeats with its bootstrap 95 % interval; ratios are the median of the "
           "per-repeat paired ratios (planaria without a spare, its configuration fixed "
           "before the runs, ÷ the best peer of that repeat, per provisioned slot), with the "
           "paired bootstrap interval; \"ahead\" only where the interval's low end is above 1 "
           "(`bench/goodput.py`'s docstring). planaria with a spare is charged its fourth "
           "slot.", "",
           "| system | configuration | goodput | samples/s |", "|---|---|---:|---:|"]
    if pl:  # rows for a system that ran
        out.append(f"| planaria | no spare | {_f(pl.get('goodput'), '.3f')}"
                   f"{_ci(pl.get('goodput_ci95'), '.3f')} | {_f(pl.get('samples_per_s'), '.1f')} |")
    if sp:
        out += [f"| planaria, 1 spare (per slot) | — | {_f(sp.get('goodput_per_slot'), '.3f')} | "
                f"{_f(sp.get('samples_per_s_per_slot'), '.1f')} |",
                f"| planaria, 1 spare (not charged) | — | {_f(sp.get('goodput'), '.3f')}"
                f"{_ci(sp.get('goodput_ci95'), '.3f')} | {_f(sp.get('samples_per_s'), '.1f')} |"]
    for name, p in (r.get("peers") or {}).items():
        out.append(f"| {name} | `{json.dumps(p.get('config'))}` | {_f(p.get('goodput'), '.3f')}"
                   f"{_ci(p.get('goodput_ci95'), '.3f')} | {_f(p.get('samples_per_s'), '.1f')} |")
    g, sps = r.get("ratio_goodput_vs_best_peer"), r.get("ratio_samples_per_s_vs_best_peer")
    sg = d.get("spares_ratio_goodput_vs_best_peer")
    out += ["", "| figure | value (95 % interval) | claim |", "|---|---:|---|"]
    if r.get("peers"):  # ratios only where a peer ran beside
        if pl:
            out += [f"| goodput ÷ best peer | {_est(g)} | {_ahead(g)} |",
                    f"| samples/s ÷ best peer | {_est(sps)} | {_ahead(sps)} |"]
        if sp:
            out.append(f"| with a spare, goodput per slot ÷ best peer | {_est(sg)} | "
                       f"{_ahead(sg)} |")
    for label, x in (("planaria", pl), ("planaria, 1 spare", sp)):
        if not x:
            continue
        out += [f"| {label}: floor | {_f(x.get('floor'), '.3f')} | — |",
                f"| {label}: lost work per kill (steps) | "
                f"{_f(x.get('lost_work_per_kill_steps'), '.3f')} | — |"]
        for target, ok in (x.get("targets") or {}).items():
            out.append(f"| {label}: {target} | — | {_ok(ok)} |")
    n = len(d.get("repeats") or [])
    if n < stats.MIN_FOR_CLAIM:
        out += ["", f"**{n} repeat(s) of the {stats.MIN_FOR_CLAIM} a claim needs**: the "
                "figures are single runs, their \"intervals\" the values themselves; no "
                "claim (—) is made from them."]
    notes = _REPO / str(rec.get("recomputed_from") or "-") / "NOTES.md"
    if rec.get("recomputed_from") and notes.is_file():  # what the raw records' folder says
        out += ["", *notes.read_text().strip().splitlines()]
    ran_at: dict[str, list[str]] = {}
    ran_on: dict[str, list[str]] = {}
    widths: list[str] = []
    for by_rep in (d.get("runs") or {}).values():
        for rep, by_v in by_rep.items():
            for v, fig in by_v.items():
                ran_at.setdefault(f"`{fig.get('commit') or 'unrecorded'}`", []).append(
                    f"{v} r{rep}")
                ran_on.setdefault(fig.get("cpu") or "unrecorded", []).append(f"{v} r{rep}")
                widths.append(f"{v} r{rep}: {fig.get('step_ms_by_width')}")
    if ran_at:
        out += ["", _runs_by("the commit they ran at", ran_at)]
    if len(ran_on) > 1:  # one machine is the section's; several are named run by run
        out += ["", _runs_by("the machine they ran on (the record's CPU; \"unrecorded\" for "
                             "records made before the records named it)", ran_on)]
    if widths:
        out += ["", "Mean step ms by width (goodput charges every useful step the full-width "
                "step time: where a narrower width runs faster, as with 3 workers on 2 cores, "
                "a system that runs narrow after a kill reads high; samples/s does not): "
                + "; ".join(widths) + "."]
    controls = d.get("controls") or {}
    if controls:
        out += ["", "Fault-free control runs (no kills; the estimator should read ~1): "
                + "; ".join(
            f"{k}: {_f(v.get('step_ms'), '.1f')} ms a step, {_f(v.get('samples_per_s'), '.1f')} "
            f"samples/s, goodput {_f(v.get('goodput'), '.3f')}" for k, v in controls.items()) + "."]
    return [*out, ""]


def render(results: dict[str, dict[str, Any]]) -> str:
    any_rec = next((r for n, r in results.items() if n not in ("gpu", "gpu_tests")), None)
    m = any_rec["machine"] if any_rec else machine()
    out = [
        "# Benchmarks",
        "",
        "Generated by `python bench/make_benchmarks_md.py` from `bench/results/*.json`; "
        "see `bench/README.md` for what each script measures and how. Every comparison "
        "runs the systems side by side in one run, so ratios come from the same machine "
        "state; the load average shows how busy the machine was.",
        "",
        f"Software: Python {m.get('python')}, torch {m.get('torch')}, ray {m.get('ray')}, "
        f"torchft {m.get('torchft')}; no GPU (the GPU section names its own machine). Each "
        "section names the machine its record was made on: they were not all made on one.",
        "",
    ]
    head = (commit() or "").removesuffix("-dirty")
    for name in _order(results):
        rec = results.get(name)
        if rec is None:
            continue
        section_start = len(out)
        if name == "overhead":
            out += render_overhead(rec)
        elif name == "overhead_before":
            out += render_overhead_change(rec, results.get("overhead"))
            out += render_overhead_ab([json.loads(p.read_text()) for p in
                                       sorted((RESULTS / "overhead-ab").glob("*.json"))])
            continue  # its own runs' outputs are in its record
        elif name.startswith("recovery"):
            out += render_recovery(rec, "" if name in BENCHES else name.removeprefix(
                "recovery-"))
        elif name == "goodput":
            out += render_goodput(rec)
        elif name.startswith("goodput-"):
            out += render_goodput_repeats(rec, name)
        elif name == "campaign":
            out += render_campaign(rec)
        elif name == "campaign_widened":
            out += render_campaign(rec, title="Fault campaign: the widened mix")
        elif name == "sharded":
            out += render_sharded(rec)
        elif name.startswith("checkpoint"):
            out += render_checkpoint(rec)
        elif name == "spares":
            out += render_spares(rec)
        elif name == "warm_join":
            out += render_warm_join(rec)
        elif name.startswith("joiner_"):
            out += render_joiner_priority(rec, route=name == "joiner_route")
        elif name == "gpu":
            out += render_gpu(rec, results.get("gpu_tests"))
        elif name == "dispatch":
            out += render_dispatch(rec)
        elif name == "sim_validation":
            out += render_sim_validation(rec)
        else:
            out += render_generic(name, rec)
        stale = stale_mark(rec, head)
        if stale:  # under the section's title
            out[section_start + 1:section_start + 1] = ["", stale]
        if rec.get("table"):
            out += [
                "<details><summary>script output</summary>",
                "",
                "```",
                *(line for line in rec["table"] if "(raylet)" not in line),
                "```",
                "",
                "</details>",
                "",
            ]
    return "\n".join(out).rstrip() + "\n"


def _load_span(raws: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The load average before the first run and after the last, from their raw records."""
    ordered = sorted(raws.values(), key=lambda r: float(r.get("t0") or 0.0))
    return {"loadavg_before": ordered[0].get("loadavg_before") if ordered else None,
            "loadavg_after": ordered[-1].get("loadavg_after") if ordered else None}


def rescore(raw_root: Path | None = None) -> list[Path]:
    """Recomputes every summary from the raw records under ``raw_root`` (``results/raw``),
    running nothing: per bench and regime, the newest commit's records. The goodput
    bench's go to ``results/goodput-<regime>.json``; the recovery bench's paired figures
    replace those of ``results/recovery.json`` (its other parts, not kept as raw records,
    stay)."""
    from bench import goodput_summary, recovery_summary

    root = raw_root or RESULTS / "raw"
    written = []
    for bench, summarize in (("goodput", goodput_summary.summarize),
                             ("recovery", recovery_summary.summarize)):
        base = root / bench
        for regime in sorted(d.name for d in base.iterdir() if d.is_dir()) if base.is_dir() \
                else []:
            folder = records.latest_raw_dir(root, bench, regime)
            if folder is None or regime == "quick":
                continue
            raws = records.read_raw(folder)
            out = summarize(raws)
            command = next((str(r["command"]) for r in raws.values() if r.get("command")), "")
            name = f"goodput-{regime}" if bench == "goodput" else "recovery"
            path = RESULTS / f"{name}.json"
            if bench == "recovery" and path.exists():
                out = {**json.loads(path.read_text())["result"], **out}
            written.append(save(name, out, command, commit=out.get("commit"),
                                machine_info=records.machine_of(raws),
                                recomputed_from=str(folder.relative_to(root.parent)
                                                    if folder.is_relative_to(root.parent)
                                                    else folder),
                                **_load_span(raws)))
    return written


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", action="store_true", help="run the bench scripts first")
    p.add_argument("--only", action="append", choices=BENCHES, help="with --run: just these")
    p.add_argument("--args", default="", help="with --run: extra arguments for every script")
    p.add_argument(
        "--ingest",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="save the last line of a captured output as NAME's result",
    )
    p.add_argument("--command", default=None, help="with --ingest: the command that produced it")
    p.add_argument("--commit", default=None,
                   help="with --ingest: the commit it ran at (default: this checkout's)")
    p.add_argument("--machine", default=None,
                   help="with --ingest: JSON describing the machine it ran on (default: this one)")
    p.add_argument("--rescore", action="store_true",
                   help="recompute the goodput and recovery results from bench/results/raw "
                   "(running nothing) before writing the page")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--out", default=str(_REPO / "BENCHMARKS.md"))
    args = p.parse_args(argv)
    for item in args.ingest:
        name, _, paths = item.partition("=")
        texts = [Path(path).read_text() for path in paths.split(",")]
        results = [last_json(text) for text in texts]
        chosen = 0
        if len(results) > 1:  # several runs: the one with the median figure, all kept
            key = MEDIAN_OF.get(name)
            if key is None:
                raise SystemExit(f"--ingest {name}=A,B,...: no figure to take the median of; "
                                 f"one of {', '.join(MEDIAN_OF)} or one output")
            order = sorted(range(len(results)), key=lambda i: results[i][key])
            chosen = order[len(order) // 2]
            results[chosen] = {**results[chosen], "repeats": [r[key] for r in results],
                               "repeats_of": key,
                               "medians": medians(results, TARGET_FIGURES.get(name, ()))}
        save(
            name,
            results[chosen],
            args.command or f"python bench/{name}.py",
            table=_table_lines(texts[chosen]),
            machine_info=json.loads(args.machine) if args.machine else None,
            **({"commit": args.commit} if args.commit else {}),
        )
    if args.run:
        for name in args.only or BENCHES:
            if name == "gpu" and not _has_cuda():
                print("skipping gpu: no CUDA device here (run bash bench/gpu_check.sh on one)")
            elif (_REPO / "bench" / f"{name}.py").exists():
                run(name, args.args.split(), args.timeout_s)
            else:
                print(f"skipping {name}: bench/{name}.py does not exist")
    if args.rescore:
        for path in rescore():
            print(f"rescored {path}")
    Path(args.out).write_text(render(load_results()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
