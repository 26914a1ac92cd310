"""The ``planaria`` command: run a spec, run the demo, report on a run, manage checkpoints."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from planaria.cli.ckpt import MissingPath, ckpt_main
from planaria.cli.config_file import write_resolved
from planaria.cli.flags import HelpWithDefaults, with_global_flags
from planaria.cli.run_dir import before_start, checkpoint_config, checkpoint_line, storage_options
from planaria.cli.runtime_env import ray_init_options
from planaria.cli.spec_file import load_spec
from planaria.cli.tracking import (
    add_tracking_flags,
    metrics_exporter,
    tracker_options,
    trackers_named,
)
from planaria.faults.errors import ConfigError

__all__ = ["load_spec", "main"]  # load_spec: planaria.cli.spec_file's, kept importable here


def _parser() -> argparse.ArgumentParser:
    from planaria._version import __version__

    parser = argparse.ArgumentParser(
        prog="planaria", description="Elastic, fault-tolerant training of PyTorch models.",
        formatter_class=HelpWithDefaults,
    )
    parser.add_argument("--version", action="version", version=f"planaria {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train a TrainSpec defined in a script")
    run.add_argument("target", nargs="?", default=None,
                     help="SCRIPT.py[:NAME]: a TrainSpec, or a function returning one "
                     "(called with the config's [spec_args]); default NAME: spec")
    _run_options(run, steps=None, replicas=None)
    run.add_argument(
        "--run-dir", default=None,
        help="a local folder (or a mounted file system) for the event log, the ledger and, "
        "unless --checkpoint-root says otherwise, the checkpoints; not a URL (required)",
    )
    COMMANDS["run"] = run

    demo = sub.add_parser(
        "demo", help="train the tiny GPT for about a minute, killing a worker partway"
    )
    _run_options(demo, steps=70, replicas=3)
    demo.add_argument("--run-dir", default=None, help="default: runs/demo-<time>")
    demo.add_argument("--no-chaos", action="store_true", help="do not kill a worker")
    COMMANDS["demo"] = demo

    report = sub.add_parser(
        "report", help="summarise a run: recovery metrics, goodput, timeline PNG"
    )
    report.add_argument("run_dir", type=Path)
    report.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    report.add_argument("--png", type=Path, default=None, help="where the timeline goes")
    report.add_argument("--run", default=None, metavar="ID",
                        help="the run to report (default: the run dir's latest)")
    report.add_argument("--all", action="store_true", help="list the run dir's runs")

    plan = sub.add_parser(
        "plan", help="simulate a large job: goodput per recovery strategy, best checkpoint interval"
    )
    from planaria.sim.cli import add_plan_arguments

    add_plan_arguments(plan)
    from planaria.faults.campaign.cli import add_parser as add_campaign_parser

    add_campaign_parser(sub)

    hook = sub.add_parser(
        "node-drain-hook",
        help="a node's SIGTERM to its planaria workers (a pod's preStop hook or entrypoint)",
        description="Gives the planaria workers on this machine their preemption notice: marks "
        "their Ray node draining (no replacement lands there), sends them SIGTERM (they leave "
        "at the next step boundary) and waits until they have left. Without COMMAND it does "
        "so now (a preStop hook); with -- COMMAND (e.g. ray start ... --block) it runs "
        "COMMAND and does so when it gets SIGTERM, then forwards the signal to COMMAND.",
    )
    hook.add_argument(
        "--grace-s", type=float, default=60.0,
        help="how long to wait for the workers to leave (keep it below the pod's "
        "terminationGracePeriodSeconds; default 60)",
    )
    hook.add_argument(
        "--worker-dir", type=Path, default=None,
        help="where the workers leave their markers (default: $PLANARIA_WORKER_DIR, else "
        "<tmp>/planaria-workers)",
    )
    hook.add_argument(
        "--no-ray-drain", action="store_true",
        help="only signal the workers; do not mark the Ray node draining",
    )
    hook.add_argument("node_command", nargs=argparse.REMAINDER,
                      help="-- COMMAND ARGS...: the node's entrypoint to run and wrap")

    ckpt = sub.add_parser("ckpt", help="list, verify and export checkpoints")
    ck = ckpt.add_subparsers(dest="ckpt_command", required=True)
    ls = ck.add_parser("ls", help="checkpoints of a run: step, size, committed, verified")
    ls.add_argument("run_dir")
    ls.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    verify = ck.add_parser("verify", help="check a checkpoint's manifest and checksums")
    verify.add_argument("path")
    export = ck.add_parser("export", help="the model weights as one safetensors file")
    export.add_argument("path")
    export.add_argument("--out", required=True)
    for command in (ls, verify, export):  # export: the options reach both ends
        command.add_argument(
            "--storage-option", action="append", default=[], metavar="KEY=VALUE",
            help="an fsspec storage option for a URL, e.g. endpoint_url=http://minio:9000 "
            "(as --checkpoint-storage-option)")
    with_global_flags(parser)
    return parser


def _run_options(p: argparse.ArgumentParser, *, steps: int | None, replicas: int | None) -> None:
    p.add_argument("--config", default=None, metavar="FILE",
                   help="options from a TOML or YAML file (keys: the flags' names, a "
                   "[checkpoint] table, target, [spec_args]); flags given here win")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set replicas=4 --set checkpoint.every=100")
    p.add_argument("--replicas", type=int, default=replicas,
                   help="replicas to train on (the width the job keeps)"
                   + (" (required)" if replicas is None else ""))
    p.add_argument("--steps", type=int, default=steps,
                   help="train until this many steps are committed"
                   + (" (required)" if steps is None else ""))
    p.add_argument("--address", default=None, help="Ray cluster address (default: start Ray here)")
    p.add_argument(
        "--runtime-env", default=None, metavar="JSON_OR_FILE",
        help="Ray runtime_env for the job, e.g. '{\"working_dir\": \".\"}' to carry your "
        "project's code to a cluster's workers (JSON, or a .json/.yaml file)",
    )
    p.add_argument(
        "--placement", default=None, choices=["spread", "strict_spread", "pack"],
        help="lay the workers out over the nodes with a placement group (default: Ray decides)",
    )
    p.add_argument(
        "--store-host", default=None,
        help="the address the controller's store listens on (default: --network-interface's "
        "address, else 127.0.0.1 on a Ray planaria started, else this node's IP as Ray sees it)",
    )
    p.add_argument(
        "--network-interface", default=None,
        help="interface (eth0) for the store and the workers' gloo (GLOO_SOCKET_IFNAME)",
    )
    p.add_argument(
        "--chaos", default=None, help="faults to inject, e.g. kill:w1@step40,hang:w0@90s"
    )
    p.add_argument(
        "--checkpoint-every", default="auto",
        help="N steps, a duration (10m, 90s), auto (the default: Young/Daly's interval from "
        "the measured save stall and failure rate) or none (no saves: a crash of this "
        "process retrains from step 0)",
    )
    p.add_argument(
        "--checkpoint-root", default=None, metavar="URL_OR_PATH",
        help="where checkpoints go: a path every node reaches, or s3://, gs:// (default: "
        "RUN_DIR/checkpoints)",
    )
    p.add_argument(
        "--checkpoint-storage-option", action="append", default=[], metavar="KEY=VALUE",
        help="an fsspec storage option for the checkpoint root, e.g. endpoint_url=http://"
        "minio:9000 (repeat for several; a VALUE that reads as JSON, such as true or 3, is "
        "taken as such)",
    )
    p.add_argument(
        "--final-save-fallback", default=None, metavar="URL_OR_PATH",
        help="if the final checkpoint cannot be written to the checkpoint root (a full disk), "
        "save the trained state here instead (another disk, a bucket; a URL gets the "
        "--checkpoint-storage-option options) rather than lose it",
    )
    p.add_argument("--no-resume", action="store_true", help="ignore the run dir's checkpoints")
    p.add_argument(
        "--checkpoint-on-other-run", default="refuse", choices=["refuse", "overwrite", "branch"],
        help="with --no-resume, what to do with checkpoints already in the run dir: refuse to "
        "start, delete them, or keep them beside this run's (a separate lineage)",
    )
    p.add_argument(
        "--on-worker-lost", default="resize", choices=["resize", "pause", "restore", "abort"]
    )
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument(
        "--spares", type=int, default=0,
        help="standby workers kept warm, which take a lost worker's place at once",
    )
    p.add_argument(
        "--warm-start", default="auto", choices=["auto", "on", "off"],
        help="fork workers from a server that imported torch once (auto: on a one-node Ray)",
    )
    p.add_argument(
        "--workers-per-replica", type=int, default=1,
        help="workers per replica, sharding its state with FSDP2 (a replica fails as one)",
    )
    p.add_argument("--ledger", action="store_true", help="record the samples every step served")
    p.add_argument("--eval-every", type=int, default=None,
                   help="evaluate the spec's eval set every N committed steps")
    p.add_argument("--loader-workers", type=int, default=0,
                   help="processes per worker that load samples (for costly decoding)")
    p.add_argument(
        "--overlap-reduction", action="store_true",
        help="all-reduce the gradients in buckets during the last backward (as DDP does)",
    )
    p.add_argument(
        "--verify-every",
        type=int,
        default=None,
        help="compare the replicas' parameter checksums every N steps",
    )
    add_tracking_flags(p)
    p.add_argument("--gpu", action="store_true", help="train on GPUs (one per worker, NCCL)")
    p.add_argument("--gpus-per-worker", type=float, default=1.0,
                   help="with --gpu: a fraction lets workers share a GPU (over gloo)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="process group backend (auto: NCCL with whole GPUs, else gloo)")
    p.add_argument("--quiet", action="store_true", help="no progress display")


def _train(args: argparse.Namespace, spec: Any, run_dir: Path) -> Any:
    from planaria.control.policy import RecoveryPolicy
    from planaria.fit import fit
    from planaria.observe.progress import ProgressDisplay

    listeners: list[Any] = []
    display = ProgressDisplay(
        args.steps, args.replicas, quiet=args.quiet, events_path=run_dir / "events.jsonl"
    )
    listeners.append(display)
    loggers = trackers_named(args)
    exporter = metrics_exporter(args, spec.name)
    if exporter is not None:
        listeners.append(exporter)
    if args.verbose:
        from planaria.observe.logs import log_event

        listeners.append(log_event)
    checkpoint = checkpoint_config(args)
    print(checkpoint_line(checkpoint, run_dir))
    policy = RecoveryPolicy(on_worker_lost=args.on_worker_lost, min_replicas=args.min_replicas)
    display.start()
    try:
        return fit(
            spec,
            steps=args.steps,
            replicas=args.replicas,
            run_dir=run_dir,
            address=args.address,
            ray_init_kwargs=ray_init_options(args.runtime_env),
            placement=args.placement,
            store_host=args.store_host,
            network_interface=args.network_interface,
            policy=policy,
            chaos=args.chaos,
            checkpoint=checkpoint,
            ledger=args.ledger,
            eval_every=args.eval_every,
            loader_workers=args.loader_workers,
            verify_every=args.verify_every,
            spares=args.spares,
            warm_start={"auto": None, "on": True, "off": False}[args.warm_start],
            workers_per_replica=args.workers_per_replica,
            overlap_reduction=args.overlap_reduction,
            use_gpu=args.gpu,
            gpus_per_worker=args.gpus_per_worker,
            backend=args.backend,
            listeners=listeners,  # the display among them: fit draws none of its own
            progress=False,
            loggers=loggers,
            tracker_options=tracker_options(args, run_dir),
        )
    finally:
        display.stop()
        if exporter is not None:
            exporter.close()


COMMANDS: dict[str, argparse.ArgumentParser] = {}
"""The subcommands that take a config file, by name (filled by :func:`_parser`)."""

_REQUIRED = {"run": ("target", "replicas", "steps", "run_dir")}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with ``--config`` and ``--set`` under the flags given."""
    parser = _parser()
    args = parser.parse_args(argv)
    command = COMMANDS.get(args.command)
    if command is None:
        return args
    from planaria.cli.config_file import file_values

    try:
        values = file_values(args.config, args.set, command)
    except ConfigError as err:
        command.error(str(err))
    for dest, value in values.items():
        if getattr(args, dest, None) == command.get_default(dest):
            setattr(args, dest, value)
    missing = [d for d in _REQUIRED.get(args.command, ()) if getattr(args, d, None) is None]
    if missing:
        command.error("missing " + ", ".join(
            "SCRIPT.py[:NAME] (or target = ... in --config)" if d == "target"
            else f"--{d.replace('_', '-')} (or {d} = ... in --config)" for d in missing))
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from planaria.config import local_run_dir
    from planaria.faults.errors import (
        CheckpointError,
        ConfigError,
        ElasticRuntimeError,
        FinalSaveFailed,
        UserCodeError,
    )
    from planaria.observe.logs import setup_logging

    setup_logging(args.verbose)
    try:
        if args.command == "run":
            args.run_dir = local_run_dir(args.run_dir)  # a URL is refused before any write
            finished = before_start(args.run_dir, args.steps, checkpoint_config(args))
            if finished is not None:  # nothing to train: Ray and the workers never start
                print(finished)
                return 0
            spec = load_spec(args.target, getattr(args, "spec_args", None))
            write_resolved(args, args.run_dir)
            result = _train(args, spec, args.run_dir)
            print(
                f"done: {result.final_step} steps; run dir {args.run_dir} "
                f"(planaria report {args.run_dir})"
            )
            return 0
        if args.command == "demo":
            return _demo(args)
        if args.command == "report":
            from planaria.observe.report import report_main

            return report_main(args.run_dir, json=args.json, png=args.png, run=args.run,
                               all_runs=args.all)
        if args.command == "ckpt":
            return ckpt_main(args)
        if args.command == "plan":
            from planaria.sim.cli import plan_main

            return plan_main(args)
        if args.command == "node-drain-hook":
            from planaria.control.drain import node_drain_hook

            command = list(args.node_command)
            if command and command[0] == "--":
                command = command[1:]
            return node_drain_hook(
                command, grace_s=args.grace_s, folder=args.worker_dir,
                ray_drain=not args.no_ray_drain,
            )
        if args.command == "campaign":
            from planaria.faults.campaign.cli import campaign_main

            return campaign_main(args)
    except FinalSaveFailed as err:
        return _final_save_failed(err, args)
    except (ConfigError, MissingPath) as err:
        print(f"planaria: {err}", file=sys.stderr)
        return 2
    except CheckpointError as err:  # a refusal (another run's checkpoints, a held lease)
        print(f"planaria: {err}", file=sys.stderr)
        return 1
    except UserCodeError as err:
        print(f"planaria: your code raised an error; the job stopped.\n{err}", file=sys.stderr)
        return 1
    except ElasticRuntimeError as err:
        cause = f" (last failure: {err.__cause__})" if err.__cause__ else ""
        print(f"planaria: {err}{cause}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _final_save_failed(err: Any, args: argparse.Namespace) -> int:
    """The final checkpoint did not commit; the job is still open with the trained state:
    save it at ``--final-save-fallback`` if given, say where the newest durable checkpoint
    is, and close the job."""
    job = err.job
    saved: str | None = None
    try:
        print(f"planaria: the final checkpoint (step {err.step}) could not be written: "
              f"{err.__cause__ or err}", file=sys.stderr)
        fallback = getattr(args, "final_save_fallback", None)
        if fallback:
            options = storage_options(args.checkpoint_storage_option) if "://" in fallback else {}
            try:
                saved = job.save(root=fallback, storage_options=options)
            except Exception as again:
                print(f"planaria: saving it under --final-save-fallback {fallback} failed too: "
                      f"{type(again).__name__}: {again}", file=sys.stderr)
        if saved is not None:
            print(f"planaria: the trained state of step {err.step} is saved at {saved} "
                  f"instead; resume from it with --checkpoint-root {fallback}", file=sys.stderr)
            return 0
        newest = (f"step {err.newest_step} at {err.newest_path}" if err.newest_path
                  else "none")
        print(f"planaria: the trained state of step {err.step} is lost with this process; the "
              f"newest durable checkpoint is {newest} (the same command resumes from it). To "
              "keep the final state when the checkpoint root cannot take it, give "
              "--final-save-fallback URL_OR_PATH (another disk or a bucket); from Python, "
              "FinalSaveFailed.job.save(root=...)", file=sys.stderr)
        return 1
    finally:
        job.close(status="ok" if saved else "aborted", error=f"final save failed: {err.__cause__}")


def _demo(args: argparse.Namespace) -> int:
    from planaria.config import local_run_dir
    from planaria.examples import tiny_gpt

    run_dir = local_run_dir(args.run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
    finished = before_start(run_dir, args.steps, checkpoint_config(args))
    if finished is not None:
        print(finished)
        return 0
    write_resolved(args, run_dir)
    if args.chaos is None and not args.no_chaos:
        args.chaos = f"kill:w1@step{max(1, args.steps // 3)}"
    print(
        f"planaria demo: tiny GPT ({args.replicas} replicas, {args.steps} steps) on the Python "
        f"standard library's source; run dir {run_dir}"
    )
    if args.chaos:
        print(
            f"chaos: {args.chaos} (a real SIGKILL; watch training go on and the replacement join)"
        )
    result = _train(args, tiny_gpt.spec, run_dir)
    held_out = tiny_gpt.evaluate(result.state_dict, batches=4)
    print(
        f"held-out loss {held_out:.3f} (started near {result.losses[0][1]:.3f}); "
        f"see `planaria report {run_dir}` for the timeline"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
