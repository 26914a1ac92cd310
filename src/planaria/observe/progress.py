"""Live progress of ``planaria run`` and ``fit()``: an event listener that draws on the terminal.

On a terminal it shows a rich progress bar (step/total, loss, live replicas,
samples/s, ETA) with recovery lines printed above it as they happen; while the bar
is live, log records (planaria's, the user's) are printed above it too, through the
same console, so a warning never breaks the bar. When the console is not a terminal
(a pipe, a log file) it prints plain lines, no control codes: the recovery lines and
a status line every ``every_s`` seconds. Either way a log record that only restates
an event the display prints (``planaria.observe.logs.RESTATES``) is left out.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, TextIO, cast

from rich.console import Console
from rich.file_proxy import FileProxy
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from rich.text import Text

from planaria.observe.logs import logs_beside_display
from planaria.observe.segments import num

if TYPE_CHECKING:
    from planaria.observe.metrics import RunSummary

__all__ = ["SHOWN_EVENTS", "ProgressDisplay"]

SHOWN_EVENTS = frozenset({
    "fault", "replacement_requested", "spare_lost", "recovered", "joined", "checkpoint_saved",
    "checkpoint_failed", "restore", "action", "replacement_failed", "preempt_notice",
    "drained", "eval", "step_skipped", "run_end"})
"""The events :class:`ProgressDisplay` prints a line for (some only in a case:
``replacement_requested`` of a spare, ``action`` pause)."""

_VERBS = {"worker_lost": "lost", "lost": "lost", "worker_hung": "hung", "hung": "hung",
          "preempted": "preempted", "preemption": "preempted",
          "replica_divergence": "diverged"}


def _through(console: Console, stream: TextIO) -> TextIO:
    """``stream`` written through ``console``: each line printed above its live display."""
    return cast(TextIO, FileProxy(console, cast(IO[str], stream)))


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    m, s = divmod(int(seconds + 0.5), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressDisplay:
    """Shows a run's progress; register with ``EventLog.add_listener(display)``.

    ``quiet=True`` prints nothing at all. ``summary=True`` prints the run
    summary (:func:`planaria.observe.report.render_summary`) at :meth:`stop`,
    ``summary="line"`` one line of it. Safe to call from any thread.
    """

    def __init__(
        self,
        total_steps: int,
        target_replicas: int,
        *,
        console: Console | None = None,
        quiet: bool = False,
        summary: bool | Literal["line"] = True,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        events_path: Path | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.target_replicas = target_replicas
        self.console = console if console is not None else Console(stderr=False)
        self.quiet = quiet
        self.summary = summary
        self.every_s = every_s
        self._clock = clock
        self._tty = self.console.is_terminal and not self.console.is_dumb_terminal
        self._lock = threading.Lock()
        # With the event log's path, the summary reads the log and memory stays bounded over a
        # long run; without it, every record is kept for the summary.
        self.events_path = events_path
        self._events: deque[dict[str, Any]] = deque(maxlen=1000 if events_path else None)
        self._recent: deque[tuple[float, float]] = deque(maxlen=20)  # (t, samples) per commit
        self._step = -1
        self._loss: float | None = None
        self._width: int | None = None
        self._workers: dict[Any, str] = {}  # fault_id -> worker
        self._joining: set[str] = set()  # workers replaced, whose replacement has not joined
        self._spares: set[str] = set()  # hot spares standing by
        self._spares_seen = False
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._last_status = -float("inf")
        self._status_step = -1  # the step of the last status line printed (plain mode)
        self._logs = contextlib.ExitStack()  # the logging set-up while the display runs

    @property
    def terminal(self) -> bool:
        """True where the display draws a live bar (its console is a terminal)."""
        return self._tty

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        if self.quiet:
            return
        if self._tty:
            self._progress = Progress(
                TextColumn("[bold]step"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"), console=self.console,
            )
            self._task = self._progress.add_task("run", total=self.total_steps, status="")
            console = self._progress.console
            # Before the bar starts, which sends sys.stderr through the console: the handlers
            # on stderr are still found by it.
            self._logs.enter_context(logs_beside_display(
                SHOWN_EVENTS, through=lambda stream: _through(console, stream)))
            self._progress.start()
        else:
            self._logs.enter_context(logs_beside_display(SHOWN_EVENTS))
            self._print(f"run: {self.total_steps} steps on {self.target_replicas} replicas")

    def stop(self) -> None:
        with self._lock:
            if self._progress is not None:
                self._progress.stop()
                self._progress = None
            if not self._tty and not self.quiet and self._step > self._status_step:
                self._print(self.status_line())  # the steps since the last status line
        self._logs.close()  # after the bar: a record meanwhile still goes above it
        if self.summary == "line" and not self.quiet and self._events:
            self._print(self.summary_line())
        elif self.summary and not self.quiet and self._events:
            from planaria.observe.report import render_summary

            render_summary(self._summarize(), self.console)

    def __enter__(self) -> ProgressDisplay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- state ---------------------------------------------------------------
    def samples_per_s(self) -> float | None:
        """Committed samples per second over the last commits (None before two)."""
        if len(self._recent) < 2:
            return None
        span = self._recent[-1][0] - self._recent[0][0]
        samples = sum(s for _, s in list(self._recent)[1:])
        return samples / span if span > 0 else None

    def eta_s(self) -> float | None:
        if len(self._recent) < 2 or self._step < 0:
            return None
        per_step = (self._recent[-1][0] - self._recent[0][0]) / (len(self._recent) - 1)
        return max(self.total_steps - (self._step + 1), 0) * per_step

    def status_line(self) -> str:
        loss = "-" if self._loss is None else f"{self._loss:.4g}"
        sps = self.samples_per_s()
        return (f"step {self._step + 1}/{self.total_steps}  loss {loss}  "
                f"replicas {self._width if self._width is not None else '-'}"
                f"/{self.target_replicas}  "
                f"{'-' if sps is None else f'{sps:.1f}'} samples/s  ETA {_eta(self.eta_s())}"
                + (f"  spares {len(self._spares)}" if self._spares_seen else ""))

    def summary_line(self) -> str:
        """The run in one line: status, steps, wall time, faults, goodput."""
        s = self._summarize()
        unrecovered = sum(not f.recovered for f in s.faults)
        where = (f"; planaria report {self.events_path.parent}"
                 if self.events_path is not None else "")
        return (f"run {s.status}: {s.steps.get('committed', 0)} steps in "
                f"{s.wall_s or 0:.1f} s, {len(s.faults)} faults ({unrecovered} unrecovered), "
                f"goodput {s.goodput:.1%}{where}")

    def _summarize(self) -> RunSummary:
        from planaria.observe.metrics import summarize

        records = list(self._events)
        if self.events_path is not None and self.events_path.exists():
            from planaria.observe.events import read_events

            records = read_events(self.events_path).events
        return summarize(records)

    def __call__(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(record)
            line, style = self._line(record)
            if self.quiet:
                return
            if line:
                self._print(line, style)
            if self._progress is not None and self._task is not None:
                self._progress.update(self._task, completed=self._step + 1,
                                      status=self.status_line().split("  ", 1)[1])
            elif record["event"] == "step_committed" and not self._tty:
                now = self._clock()
                if now - self._last_status >= self.every_s or self._step + 1 >= self.total_steps:
                    self._last_status = now
                    self._status_step = self._step
                    self._print(self.status_line())

    def _print(self, line: str, style: str | None = None) -> None:
        target = self._progress.console if self._progress is not None else self.console
        target.print(Text(line, style=style or ""), highlight=False)

    def _line(self, r: dict[str, Any]) -> tuple[str | None, str | None]:
        """Updates the state from one record; returns a line to print, if any."""
        ev = r["event"]
        if ev == "step_committed":
            self._step = int(num(r.get("step")) or 0)
            self._loss = num(r.get("loss"))
            self._width = int(num(r.get("width")) or 0)
            self._recent.append((float(r["t"]), num(r.get("samples")) or 0.0))
        elif ev == "generation":
            self._width = int(num(r.get("world_size")) or 0)
        elif ev == "fault":
            self._workers[r.get("fault_id")] = r.get("worker") or "job"
            return (f"fault: {r.get('worker') or 'job'} {r.get('kind')} at step {r.get('step')}",
                    "yellow")
        elif ev == "replacement_requested":
            self._joining.add(str(r.get("replaces")))
            if r.get("spare"):
                self._spares.discard(str(r.get("worker")))
                return f"spare {r.get('worker')} takes {r.get('replaces')}'s place", None
        elif ev == "spare_ready":
            self._spares_seen = True
            self._spares.add(str(r.get("worker")))
        elif ev == "spare_lost":
            self._spares.discard(str(r.get("worker")))
            return f"spare {r.get('worker')} was lost while standing by", "yellow"
        elif ev == "recovered":
            who = self._workers.get(r.get("fault_id"), "job")
            kind = next((e.get("kind") for e in reversed(self._events)
                         if e["event"] == "fault" and e.get("fault_id") == r.get("fault_id")), None)
            verb = _VERBS.get(str(kind), str(kind) if kind else "failed")
            rs = num(r.get("recover_s"))
            joining = any(w in self._joining for w in who.split(","))
            tail = ", replacement joining" if joining else ""
            lost = int(num(r.get("lost_steps")) or 0)
            tail += f", {lost} steps lost" if lost else ""
            return (f"{who} {verb} → {self._width} replicas in "
                    f"{'-' if rs is None else f'{rs:.2f}'} s{tail}", "green")
        elif ev == "joined":
            self._joining.discard(next((str(e.get("replaces")) for e in self._events
                                        if e["event"] == "replacement_requested"
                                        and e.get("worker") == r.get("worker")), ""))
            return f"{r.get('worker')} joined (hot-join {num(r.get('join_s')) or 0:.1f} s)", "green"
        elif ev == "checkpoint_saved":
            return (f"checkpoint step {r.get('step')} saved "
                    f"(stall {num(r.get('stall_s')) or 0:.2f} s)", None)
        elif ev == "checkpoint_failed":
            return f"checkpoint step {r.get('step')} failed: {r.get('error')}", "yellow"
        elif ev == "restore":
            return (f"restored step {r.get('step')} in {num(r.get('restore_s')) or 0:.2f} s "
                    f"({r.get('lost_steps', 0)} steps lost)", "yellow")
        elif ev == "action" and r.get("action") == "pause":
            return "paused: waiting for replacements", "yellow"
        elif ev == "replacement_failed":
            return (f"replacement {r.get('worker')} failed to start "
                    f"(attempt {r.get('attempt')}): {r.get('error')}", "yellow")
        elif ev == "preempt_notice":
            return f"{r.get('worker')} got a preemption notice at step {r.get('step')}", "yellow"
        elif ev == "drained":
            return f"{r.get('worker')} drained at step {r.get('step')}", None
        elif ev == "eval":
            figures = ", ".join(f"{k} {v:.4g}" if isinstance(v, (int, float)) else f"{k} {v}"
                                for k, v in (r.get("metrics") or {}).items())
            return (f"eval at step {r.get('step')}: {figures} ({r.get('samples')} samples, "
                    f"{num(r.get('seconds')) or 0:.2f} s)", "cyan")
        elif ev == "step_skipped":
            return f"step {r.get('step')} skipped ({r.get('reason')})", "yellow"
        elif ev == "run_end":
            err = f": {r.get('error')}" if r.get("error") else ""
            return f"run {r.get('status')} at step {r.get('step')}{err}", None
        return None, None
