"""The controller's store listens on the one address the workers reach it by."""

from __future__ import annotations

import socket

import pytest

from planaria import ConfigError, RunConfig
from planaria.control.network import (
    host_store,
    store_address,
    warn_if_gloo_would_use_loopback,
    worker_env,
)
from planaria.wire.interfaces import interface_address


def other_address() -> str | None:
    """An IPv4 address of this machine other than the loopback, if it has one."""
    for _, name in socket.if_nameindex():
        try:
            address = interface_address(name)
        except ConfigError:
            continue
        if not address.startswith("127."):
            return address
    return None


def test_store_listens_on_the_given_address_only():
    store = host_store("127.0.0.1", timeout_s=5)
    with socket.create_connection(("127.0.0.1", store.port), timeout=5):
        pass
    other = other_address()
    if other is None:
        pytest.skip("this machine has no address but the loopback")
    with pytest.raises(ConnectionRefusedError), socket.socket() as s:
        s.settimeout(5)
        s.connect((other, store.port))  # torch alone would listen here too (on *:port)


def test_store_address_and_worker_environment(tmp_path):
    base = {"steps": 1, "replicas": 1, "run_dir": tmp_path}
    assert store_address(RunConfig(**base), private=True) == "127.0.0.1"
    assert store_address(RunConfig(**base, store_host="10.1.2.3"), private=False) == "10.1.2.3"
    lo = RunConfig(**base, network_interface="lo")
    assert store_address(lo, private=True) == interface_address("lo") == "127.0.0.1"
    assert worker_env(lo) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert worker_env(RunConfig(**base)) == {}
    with pytest.raises(ConfigError, match="network_interface='no-such0'"):
        store_address(RunConfig(**base, network_interface="no-such0"), private=False)


def test_warns_when_gloo_would_bind_the_loopback(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "127.0.1.1")
    base = {"steps": 1, "replicas": 1, "run_dir": tmp_path}
    with caplog.at_level("WARNING", logger="planaria.membership"):
        warn_if_gloo_would_use_loopback(RunConfig(**base), private=True)
        warn_if_gloo_would_use_loopback(RunConfig(**base, network_interface="lo"), private=False)
        assert not caplog.records
        warn_if_gloo_would_use_loopback(RunConfig(**base), private=False)
    assert "127.0.1.1" in caplog.text and "network_interface" in caplog.text
