"""``planaria campaign SCRIPT.py[:SPEC] --faults N --seed S``: the sub-command's options."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from planaria.campaign.mix import DEFAULT_STEP_S, KINDS

__all__ = ["add_parser", "campaign_main"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "campaign",
        help="seeded fault campaign: a reference run, then runs with faults over the whole mix",
        description="Runs a reference without faults, then runs with faults drawn from the "
        "mix, checks each against the reference (final weights, exactly-once ledger, no healthy "
        "worker evicted, no restart from step 0, every fault in the report) and prints one "
        "JSON summary as its last line.",
    )
    p.add_argument("target", help="SCRIPT.py[:SPEC_NAME] (default name: spec)")
    p.add_argument("--faults", type=int, required=True, help="how many faults in all")
    p.add_argument("--seed", type=int, default=0, help="seeds the whole schedule")
    p.add_argument("--mix", default=",".join(KINDS),
                   help=f"comma-separated fault kinds (default: all of {', '.join(KINDS)})")
    p.add_argument("--step-s", default=",".join(f"{s:g}" for s in DEFAULT_STEP_S),
                   help="comma-separated step lengths in seconds (the loss is slowed to them)")
    p.add_argument("--faults-per-run", default="3-5", help="LO-HI faults per run")
    p.add_argument("--gap", type=int, default=3, help="steps between two faults of a run")
    p.add_argument("--checkpoint-every", type=int, default=3,
                   help="checkpoint interval in steps (the first fault comes after two)")
    p.add_argument("--tail", type=int, default=3, help="steps after a run's last fault")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path("runs/campaign"),
                   help="run dirs go here, kept for post-mortem; the reference is reused")
    p.add_argument("--parallel", type=int, default=1,
                   help="runs at a time, each its own job (long steps are mostly sleep)")
    p.add_argument("--resume", action="store_true",
                   help="runs an earlier campaign in --workdir finished (same seed and options) "
                   "are judged again from their files, not run again; the rest are run")
    p.add_argument("--record", type=Path, default=None,
                   help="JSON-lines file of finished runs, appended as they finish; runs "
                   "already in it are not run again (a campaign in parts, on the same commit)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no run after this many seconds (the rest: a later part)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the summary here")


def campaign_main(args: argparse.Namespace) -> int:
    from planaria.campaign.mix import MixConfig
    from planaria.campaign.runner import CampaignConfig, run_campaign
    from planaria.errors import ConfigError

    try:
        lo, _, hi = args.faults_per_run.partition("-")
        per_run = (int(lo), int(hi or lo))
        step_s = tuple(float(s) for s in args.step_s.split(",") if s.strip())
    except ValueError as err:
        raise ConfigError(
            f"--faults-per-run={args.faults_per_run!r} or --step-s={args.step_s!r} is not "
            "valid: use LO-HI (e.g. 3-5) and seconds separated by commas (e.g. 0.05,2)"
        ) from err
    mix = MixConfig(faults=args.faults, seed=args.seed,
                    kinds=tuple(k.strip() for k in args.mix.split(",") if k.strip()),
                    step_lengths=step_s, faults_per_run=per_run, gap=args.gap,
                    checkpoint_every=args.checkpoint_every, tail=args.tail)
    config = CampaignConfig(target=args.target, mix=mix, workdir=args.workdir,
                            replicas=args.replicas, parallel=args.parallel,
                            resume=args.resume, record=args.record,
                            time_budget_s=args.time_budget_s)
    summary = run_campaign(config, out=lambda line: print(line, flush=True))
    text = json.dumps(summary)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    print(text, flush=True)
    ok = not (summary["unrecovered"] or summary["diverged"] or summary["samples_duplicated"]
              or summary["samples_missing"] or summary["healthy_evicted"])
    if not ok:
        return 1
    return 2 if summary["runs_left"] else 0  # a part of a campaign: not a finished campaign
