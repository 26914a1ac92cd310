"""The worker's half of finding a rank that cannot be reached (:mod:`planaria.control.links`):
the listener each worker answers probes on, the probe, and the TCP connections of this
process that hold unacked bytes under retransmission (from ``/proc/net/tcp``)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "PROBE_TIMEOUT_S",
    "LinkReport",
    "ProbeServer",
    "local_endpoints",
    "probe",
    "proc_net_endpoint",
    "stalled_connections",
]

_log = logging.getLogger("planaria.wire.probes")

PROBE_TIMEOUT_S = 1.0
"""How long a probe waits for a rank to answer."""


@dataclass(frozen=True, kw_only=True)
class LinkReport:
    """A rank's answer to the controller's link check (``Worker.probe_links``)."""

    reached: Mapping[str, bool] = field(default_factory=dict)
    """Peer name -> did its probe listener answer this rank."""
    stalled: tuple[tuple[str, str], ...] = ()
    """This process's TCP connections (local, remote ``host:port``) whose bytes go unacked."""
    endpoints: tuple[str, ...] = ()
    """This process's local TCP endpoints (to tell whose end a stalled flow's remote is)."""




class ProbeServer:
    """A TCP listener that answers every connection with one byte, on a daemon thread."""

    def __init__(self, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._serve, name="planaria-probe", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with contextlib.suppress(OSError), conn:
                conn.sendall(b"!")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone would not)
        with contextlib.suppress(OSError):
            self._sock.close()


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the :class:`ProbeServer` at ``host:port`` answers within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            return s.recv(1) == b"!"
    except (OSError, ValueError):
        return False


def _socket_inodes() -> set[int]:
    out = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith("socket:["):
                    out.add(int(target[8:-1]))
    return out


def proc_net_endpoint(hex_address: str) -> str:
    """``ip:port`` of an address as ``/proc/net/tcp`` or ``tcp6`` spells it (hex, little
    endian)."""
    addr, port = hex_address.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # /proc/net/tcp6: four little-endian 32-bit words
        words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(words))
        if ip.startswith("::ffff:"):
            ip = ip[7:]
    return f"{ip}:{int(port, 16)}"


def stalled_connections() -> list[tuple[str, str]]:
    """This process's established TCP connections whose sent bytes go unacked while the
    kernel retransmits them: ``(local, remote)`` endpoints (``ip:port``). Linux only;
    elsewhere none."""
    return [(lo, re) for lo, re, stalled in _connections() if stalled]


def local_endpoints() -> list[str]:
    """The local endpoints of this process's established TCP connections (so that a peer's
    stalled connection can be traced to this process)."""
    return [lo for lo, _, _ in _connections()]


def _connections() -> list[tuple[str, str, bool]]:
    mine = _socket_inodes()
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "01" or int(fields[9]) not in mine:
                continue
            tx_queue = int(fields[4].split(":")[0], 16)
            retransmits = int(fields[6], 16)
            # The kernel retransmits what a lost link dropped (a drop on this host, by a
            # filter, it retries as probes instead: icsk_probes_out, the "timeout" column).
            probes = int(fields[8]) if fields[8].isdigit() else 0
            out.append((proc_net_endpoint(fields[1]), proc_net_endpoint(fields[2]),
                        tx_queue > 0 and (retransmits > 0 or probes > 0)))
    return out
