"""Ray's own messages go to the run's log file, not to the user's terminal.

When a worker dies, Ray's driver prints a long "(raylet) A worker died or was
killed ... OOM killer ..." notice, and at start a banner about token
authentication. For a fault that planaria injected or handles, that text
misleads: planaria's own message (``w1 lost → 2 replicas ...``) explains the
fault. The details still matter for a post-mortem, so they are kept in
``RUN_DIR/ray.log``. Only done when planaria starts Ray itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["route_ray_logs"]

RAY_LOG = "ray.log"
_HANDLER_NAME = "planaria-ray-log"


# Loggers that speak during ray.init, which replaces the handlers of the "ray" logger itself.
_INIT_LOGGERS = ("ray._private.authentication.authentication_token_setup",)


def route_ray_logs(run_dir: Path) -> Path:
    """Sends Ray's log records and the driver's raylet notices to ``run_dir/ray.log``.

    Call it before ``ray.init`` (for what init says) and again after it (init
    reconfigures the ``ray`` logger).
    """
    path = Path(run_dir) / RAY_LOG
    handler = _RunDirFileHandler(path)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    for name in ("ray", *_INIT_LOGGERS):
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            terminal = isinstance(old, logging.StreamHandler) and not isinstance(
                old, logging.FileHandler
            )
            if terminal or old.get_name() == _HANDLER_NAME:
                logger.removeHandler(old)  # e.g. the terminal handler Ray installs at import
        logger.addHandler(handler)
        logger.propagate = False
    _divert_raylet_notices()
    return path


class _RunDirFileHandler(logging.FileHandler):
    """``ray.log`` in the run directory: a record it cannot write (a full disk) is dropped
    after one warning, not printed to the terminal with a traceback each time; later
    records are tried again."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, encoding="utf-8", delay=True)  # opened at the first record
        self.dropped = 0

    def handleError(self, record: logging.LogRecord) -> None:
        self.dropped += 1
        if self.dropped == 1:
            logging.getLogger("planaria.observe.events").warning(
                "cannot write %s: Ray's messages are dropped while it cannot be written",
                self.baseFilename)


def _divert_raylet_notices() -> None:
    """The driver prints raylet error notices through ``print_to_stdstream`` (Ray's
    private API): wrap it so that those lines go to the file. If Ray changes, the
    notices simply reach the terminal again."""
    try:
        from ray._private import worker as ray_worker
    except ImportError:  # pragma: no cover - ray is a dependency
        return
    original: Callable[..., Any] = getattr(
        ray_worker.print_to_stdstream, "__wrapped__", ray_worker.print_to_stdstream
    )
    notices = logging.getLogger("ray.raylet_notices")

    def print_to_stdstream(data: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if data.get("pid") == "raylet":
            for line in data.get("lines", []):
                notices.warning("%s", line)
            return
        original(data, *args, **kwargs)

    print_to_stdstream.__wrapped__ = original  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_to_stdstream
