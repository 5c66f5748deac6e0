"""The tests' own helpers where a fault in them would show as a flaky test elsewhere."""

from __future__ import annotations

import socket
from pathlib import Path

from mqtt_helpers import free_port


def test_free_port_is_below_the_ephemeral_range_and_free() -> None:
    """A broker's port from the range clients' ports come from can be taken by a client
    connecting to itself while the broker is down: free_port stays below that range."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1
    for port in ports:
        assert 1024 <= port < low
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))
