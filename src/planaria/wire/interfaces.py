"""A network interface's address on this machine: where the controller's store listens
(``RunConfig.network_interface``, :mod:`planaria.control.network`) and where a worker's
process group does (:func:`planaria.worker.process.group_address`)."""

from __future__ import annotations

import fcntl
import socket
import struct

from planaria.faults.errors import ConfigError

__all__ = ["interface_address"]

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` on this machine (Linux)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = struct.pack("256s", name.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, packed)[20:24])
    except OSError as err:
        have = ", ".join(n for _, n in socket.if_nameindex())
        raise ConfigError(
            f"network_interface={name!r} is not valid: this machine has no interface of that "
            f"name with an IPv4 address ({err.strerror}); it has {have}"
        ) from err
