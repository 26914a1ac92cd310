"""``planaria campaign [SCRIPT.py[:SPEC]] --faults N --seed S``: the sub-command's options."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from planaria.faults.campaign.mix import DEFAULT_STEP_S, INTERVALS, KINDS
from planaria.faults.campaign.specs import CAMPAIGN_SPECS

__all__ = ["add_parser", "campaign_main"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "campaign",
        help="seeded fault campaign: runs with faults and configurations drawn from the mix, "
        "each checked against an independent reference",
        description="Runs jobs with faults drawn from the mix, each in a configuration drawn "
        "too (spec, width, sharding, spares, overlapped reduction, checkpoint interval, or "
        "the user's defaults), checks each against a plain single-process reference (every "
        "member's final weights, exactly-once, no healthy worker evicted, every fault in the "
        "report, every recovery inside its bound, no process left) and prints one JSON "
        "summary as its last line.",
    )
    p.add_argument("target", nargs="?", default=None,
                   help="SCRIPT.py[:SPEC_NAME] (default name: spec); without it, every run "
                   "draws one of the campaign's specs (--specs)")
    p.add_argument("--specs", default=",".join(CAMPAIGN_SPECS),
                   help=f"comma-separated campaign specs drawn per run (of "
                   f"{', '.join(CAMPAIGN_SPECS)}; ignored with a target)")
    p.add_argument("--faults", type=int, required=True, help="how many faults in all")
    p.add_argument("--seed", type=int, default=0, help="seeds the whole schedule")
    p.add_argument("--mix", default=",".join(KINDS),
                   help=f"comma-separated fault kinds (default: all of {', '.join(KINDS)})")
    p.add_argument("--step-s", default=",".join(f"{s:g}" for s in DEFAULT_STEP_S),
                   help="comma-separated step lengths in seconds (the loss is slowed to them)")
    p.add_argument("--faults-per-run", default="3-5", help="LO-HI faults per run")
    p.add_argument("--gap", type=int, default=3, help="steps between two faults of a run")
    p.add_argument("--checkpoint-every", default=",".join(str(i) for i in INTERVALS),
                   help="comma-separated checkpoint intervals drawn per run (steps, or auto; "
                   "the first fault comes after two)")
    p.add_argument("--tail", type=int, default=3, help="steps after a run's last fault")
    p.add_argument("--replicas", default="2-4", help="LO-HI replicas drawn per run")
    p.add_argument("--defaults-share", type=float, default=0.25,
                   help="share of runs on the user's defaults (no ledger, interval auto)")
    p.add_argument("--workdir", type=Path, default=Path("runs/campaign"),
                   help="run dirs go here, kept for post-mortem")
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


def _range(text: str, what: str) -> tuple[int, int]:
    from planaria.faults.errors import ConfigError

    try:
        lo, _, hi = text.partition("-")
        return int(lo), int(hi or lo)
    except ValueError as err:
        raise ConfigError(f"{what}={text!r} is not valid: use LO-HI (e.g. 3-5)") from err


def campaign_main(args: argparse.Namespace) -> int:
    from planaria.faults.campaign.mix import MixConfig
    from planaria.faults.campaign.runner import CampaignConfig, campaign_ok, run_campaign
    from planaria.faults.errors import ConfigError

    per_run = _range(args.faults_per_run, "--faults-per-run")
    replicas = _range(args.replicas, "--replicas")
    try:
        step_s = tuple(float(s) for s in args.step_s.split(",") if s.strip())
        intervals = tuple(s.strip() if s.strip() == "auto" else int(s)
                          for s in args.checkpoint_every.split(",") if s.strip())
    except ValueError as err:
        raise ConfigError(
            f"--step-s={args.step_s!r} or --checkpoint-every={args.checkpoint_every!r} is not "
            "valid: use seconds separated by commas (e.g. 0.05,2) and steps or auto (2,3,auto)"
        ) from err
    micro_batches = 8  # the campaign's specs'
    if args.target is not None:
        from planaria.faults.campaign.specs import build_spec, has_buffers

        spec = build_spec(args.target, control=None)
        specs: tuple[str, ...] = (args.target,)
        shardable = () if has_buffers(spec) else specs
        micro_batches = spec.global_batch_size // spec.micro_batch_size
        replicas = (min(replicas[0], micro_batches), min(replicas[1], micro_batches))
    else:
        specs = tuple(s.strip() for s in args.specs.split(",") if s.strip())
        shardable = tuple(s for s in specs if s != "bn_mlp")
    mix = MixConfig(faults=args.faults, seed=args.seed,
                    kinds=tuple(k.strip() for k in args.mix.split(",") if k.strip()),
                    step_lengths=step_s, faults_per_run=per_run, gap=args.gap,
                    intervals=intervals, tail=args.tail, specs=specs, shardable=shardable,
                    replicas=replicas, defaults_share=args.defaults_share,
                    step_micro_batches=micro_batches)
    config = CampaignConfig(mix=mix, workdir=args.workdir, parallel=args.parallel,
                            resume=args.resume, record=args.record,
                            time_budget_s=args.time_budget_s)
    summary = run_campaign(config, out=lambda line: print(line, flush=True))
    text = json.dumps(summary)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    print(text, flush=True)
    if not campaign_ok(summary):
        return 1
    return 2 if summary["runs_left"] else 0  # a part of a campaign: not a finished campaign
