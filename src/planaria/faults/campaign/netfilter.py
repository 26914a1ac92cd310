"""A dead process-group link, for real: netfilter drops a worker's flows to its peers.

The campaign's ``link_stall`` (and the link-stall tests) cut a worker off from its peers
while it runs and its heartbeat lives: every established TCP flow between the worker's
process and its peers' processes (its process group's links; its store and Ray
connections go elsewhere) is dropped both ways, by rules in a netfilter chain of its own
(:class:`Chain`), which the campaign removes after the run. Needs root and Debian's
``iptables``; :func:`available` says whether they are there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

from planaria.wire.probes import proc_net_endpoint

__all__ = ["Chain", "available", "cut_links", "run_chain", "tcp_endpoints"]


def run_chain(run_index: int) -> str:
    """The netfilter chain a campaign run's link stalls put their rules in."""
    return f"PLANARIA-RUN-{run_index}"


def _iptables(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["iptables", "-w", *args], capture_output=True, text=True,
                          timeout=30, check=check)


def available() -> bool:
    """Root and iptables are here."""
    return shutil.which("iptables") is not None and os.geteuid() == 0


class Chain:
    """A netfilter chain of our own, jumped to from OUTPUT (every local packet passes it)."""

    def __init__(self, name: str) -> None:
        self.name = name[:28]  # iptables' limit

    def create(self) -> bool:
        """Makes the chain and its jump; False where netfilter is not usable."""
        if not available():
            return False
        self.remove()
        return (_iptables("-N", self.name).returncode == 0
                and _iptables("-I", "OUTPUT", "-j", self.name).returncode == 0)

    def remove(self) -> None:
        """Removes the jump, the rules and the chain (whatever of them exists)."""
        if not available():
            return
        while _iptables("-D", "OUTPUT", "-j", self.name).returncode == 0:
            pass
        _iptables("-F", self.name)
        _iptables("-X", self.name)


def tcp_endpoints(pid: int) -> dict[int, tuple[str, str]]:
    """Socket inode -> (local, remote) of process ``pid``'s established TCP connections."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    out = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[3] == "01" and int(fields[9]) in inodes:
                    out[int(fields[9])] = (proc_net_endpoint(fields[1]),
                                           proc_net_endpoint(fields[2]))
    return out


def cut_links(peers: list[int], chain: str, pid: int | None = None) -> int:
    """Drops, both ways, every established TCP flow between process ``pid`` (this one by
    default) and the ``peers`` processes, with rules in ``chain``; returns how many flows."""
    theirs = {local for peer in peers for local, _ in tcp_endpoints(peer).values()}
    flows = [(lo, re) for lo, re in tcp_endpoints(pid or os.getpid()).values() if re in theirs]
    for lo, re in flows:
        (lip, lport), (rip, rport) = lo.rsplit(":", 1), re.rsplit(":", 1)
        for src, sport, dst, dport in ((lip, lport, rip, rport), (rip, rport, lip, lport)):
            _iptables("-A", chain, "-p", "tcp", "-s", src, "--sport", sport, "-d", dst,
                      "--dport", dport, "-j", "DROP", check=True)
    return len(flows)
