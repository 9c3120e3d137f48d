"""Ports a restarted server can bind again (``bench.soak.server.steady_ports``)."""

from __future__ import annotations

import socket
from pathlib import Path

from bench.soak.server import ephemeral_low, steady_ports


def test_steady_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    ports = steady_ports(3)
    assert len(set(ports)) == 3
    assert all(port < ephemeral_low() for port in ports)
    for port in ports:
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))


def test_a_port_the_kernel_hands_to_outgoing_connections_is_never_chosen(tmp_path: Path) -> None:
    # an outgoing connection's own end is a port of the ephemeral range: port 0 picks from it
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()) as client:
            own = client.getsockname()[1]
    assert own >= ephemeral_low()
    assert own not in steady_ports(50)


def test_the_range_is_read_from_the_kernel(tmp_path: Path) -> None:
    table = tmp_path / "range"
    table.write_text("40000\t60999\n")
    assert ephemeral_low(table) == 40000
    assert ephemeral_low(tmp_path / "missing") == 32768
