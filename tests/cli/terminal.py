"""Runs a command on a real pseudo-terminal (or piped) and splits what it wrote into the
pieces a terminal shows: the text between carriage returns and newlines, colours removed."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _env(columns: int) -> dict[str, str]:
    env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(columns),
               RAY_USAGE_STATS_ENABLED="0")
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    for key in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        env.pop(key, None)
    return env


def on_a_terminal(argv: list[str], *, columns: int = 120, timeout_s: float = 400) -> str:
    """``argv``'s output (stdout and stderr) as a terminal of ``columns`` received it."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=_env(columns))
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed its end
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
            raise AssertionError(f"{argv} ran past {timeout_s} s:\n{out.decode(errors='replace')}")
        assert proc.wait(30) == 0, out.decode(errors="replace")
    finally:
        os.close(master)
    return out.decode(errors="replace")


def piped(argv: list[str], *, timeout_s: float = 400) -> str:
    """``argv``'s stdout and stderr, as one pipe received them."""
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=_env(120), timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stdout
    return done.stdout


def pieces(raw: str) -> list[str]:
    """The text between carriage returns and newlines, colours and cursor moves removed:
    one piece per line printed or per redraw of the live bar."""
    return [p for p in re.split(r"[\r\n]+", _ANSI.sub("", raw)) if p.strip()]


def python(*args: str) -> list[str]:
    return [sys.executable, *args]
