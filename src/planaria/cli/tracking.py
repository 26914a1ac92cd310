"""The run's watching flags: experiment trackers (``--log-to``) and the Prometheus exporter
(``--metrics-port``, ``--metrics-host``)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

__all__ = ["add_tracking_flags", "metrics_exporter", "tracker_options", "trackers_named"]

_LIBRARY = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def add_tracking_flags(p: argparse.ArgumentParser) -> None:
    """``--log-to`` and its options, ``--metrics-port`` and ``--metrics-host``."""
    p.add_argument(
        "--log-to", default="", metavar="TRACKERS",
        help="experiment trackers, comma-separated: tensorboard, wandb, mlflow, csv "
        "(each under LOG_DIR/<name>)",
    )
    p.add_argument("--log-dir", type=Path, default=None,
                   help="where the trackers write (default: RUN_DIR/trackers)")
    p.add_argument("--log-project", default="planaria",
                   help="the W&B project and MLflow experiment")
    p.add_argument("--mlflow-uri", default=None,
                   help="MLflow tracking URI (default: a file store under LOG_DIR/mlflow)")
    p.add_argument("--wandb-mode", default=None, choices=["online", "offline"],
                   help="W&B mode (default: wandb's settings and WANDB_MODE)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics here")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="the address the Prometheus exporter binds (0.0.0.0: every interface)")


def trackers_named(args: argparse.Namespace) -> list[str]:
    """The names ``--log-to`` gives (a name not known is a ConfigError)."""
    from planaria.faults.errors import ConfigError
    from planaria.observe.trackers import parse_names

    try:
        names = parse_names(args.log_to or "")
    except ValueError as err:
        raise ConfigError(f"--log-to {args.log_to!r} is not valid: {err}") from err
    for name in names:
        module = _LIBRARY.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"--log-to {name} needs {module}: pip install \"planaria[{name}]\"")
    return names


def tracker_options(args: argparse.Namespace, run_dir: Path) -> Any:
    """The trackers' :class:`~planaria.observe.trackers.TrackerOptions` from the flags."""
    from planaria.observe.trackers import TrackerOptions

    return TrackerOptions(log_dir=args.log_dir, project=args.log_project,
                          run_name=run_dir.name, mlflow_uri=args.mlflow_uri,
                          wandb_mode=args.wandb_mode)


def metrics_exporter(args: argparse.Namespace, job_name: str) -> Any:
    """The Prometheus exporter the flags ask for (None without ``--metrics-port``)."""
    if args.metrics_port is None:
        return None
    from planaria.observe.prometheus import MetricsExporter

    exporter = MetricsExporter(args.metrics_port, addr=args.metrics_host, job=job_name)
    print(f"Prometheus metrics on http://{args.metrics_host}:{exporter.port}/metrics")
    return exporter
