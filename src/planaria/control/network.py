"""Where the controller's store listens, and which interface the workers' gloo uses.

torch's ``TCPStore(host, port, is_master=True)`` listens on every interface
whatever ``host`` is (``ss -ltn`` shows ``*:port``, torch 2.13, both backends):
``host`` only tells the clients where to connect. So planaria binds the listening
socket itself, to the one address the workers reach the store by, and hands it
to the store (``master_listen_fd``): the store then listens on that address only.

The address (:func:`store_address`): ``RunConfig.store_host`` if set, else the
address of ``RunConfig.network_interface`` if set, else the loopback when this
process started a private single-node Ray, else this node's IP as Ray knows it.
Never every interface (``0.0.0.0``) unless asked for by name.
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta

import ray
import torch.distributed as dist

from planaria.config import RunConfig
from planaria.faults.errors import ConfigError
from planaria.wire.interfaces import interface_address

__all__ = [
    "host_store",
    "ray_is_private",
    "store_address",
    "warn_if_gloo_would_use_loopback",
    "worker_env",
]

_log = logging.getLogger("planaria.membership")

def ray_is_private() -> bool:
    """True when this process started its own Ray (not connected to a running cluster) and
    it has one node: nothing on another machine can reach a worker of it."""
    node = getattr(ray._private.worker, "_global_node", None)  # None in client mode (ray://)
    if node is None or not node.is_head():
        return False
    return sum(1 for n in ray.nodes() if n.get("Alive")) == 1


def store_address(config: RunConfig, *, private: bool) -> str:
    """The address the store listens on and the workers connect to (see the module doc)."""
    if config.store_host is not None:
        return config.store_host
    if config.network_interface is not None:
        return interface_address(config.network_interface)
    if private:
        return "127.0.0.1"
    return str(ray.util.get_node_ip_address())


def host_store(host: str, *, timeout_s: float = 60.0) -> dist.TCPStore:
    """A TCPStore server listening on ``host`` only, on a free port."""
    infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError as err:
        sock.close()
        raise ConfigError(
            f"store_host={host!r} is not valid: cannot listen on it ({err.strerror}); give an "
            "address of this machine that the workers can reach"
        ) from err
    fd = sock.detach()  # the store owns the socket from here on and closes it with itself
    return dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=fd,
    )


def warn_if_gloo_would_use_loopback(config: RunConfig, *, private: bool) -> None:
    """On a cluster with no ``network_interface``, warns when this machine's hostname resolves
    to a loopback address: gloo would bind there, and peers on other nodes cannot connect
    (nodes are usually set up alike, so the workers' machines likely do the same)."""
    if private or config.network_interface is not None:
        return
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return
    if address.startswith("127."):
        _log.warning(
            "the hostname %s resolves to %s: gloo binds to the address the hostname resolves "
            "to, so workers on other nodes may fail to form a process group; set "
            "RunConfig(network_interface=...) (GLOO_SOCKET_IFNAME) to the interface the nodes "
            "reach each other by",
            host,
            address,
        )


def worker_env(config: RunConfig) -> dict[str, str]:
    """Environment variables for the workers: gloo (and NCCL) on the configured interface.

    gloo otherwise takes the address the hostname resolves to, which on many machines
    is 127.0.1.1 (``/etc/hosts``): peers on other nodes cannot reach it.
    """
    if config.network_interface is None:
        return {}
    return {
        "GLOO_SOCKET_IFNAME": config.network_interface,
        "NCCL_SOCKET_IFNAME": config.network_interface,
    }
