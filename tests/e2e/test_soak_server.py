"""The soak's ``shoal dev`` (``bench.soak.server.DevProcess``): restarted on the ports its
clients know, even when another program held one of them for a while."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

import bench.soak.server as soak_server
from bench.soak.server import DevProcess


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_restart_waits_for_a_port_another_program_holds_then_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 2-hour soak died at its 5th kill: "--aws-port 26680 is in use" (another server
    beside the run held it while shoal dev was down)."""
    monkeypatch.setattr(soak_server, "PORT_TAKEN_WAIT_S", 0.5, raising=False)
    server = DevProcess(tmp_path / "state", log_path=tmp_path / "shoal-dev.log")
    server.start()
    ports = (server.port, server.aws_port, server.ws_port)
    try:
        # Given the server killed, and another program listening on its emulator's port
        server.kill()
        holder = socket.socket()
        holder.bind(("127.0.0.1", server.aws_port))
        holder.listen()
        released = threading.Timer(3.0, holder.close)
        released.start()
        # When it starts again
        server.start()
        # Then it waited for the port and serves on the same ports as before
        assert (server.port, server.aws_port, server.ws_port) == ports
        assert server.healthy()
        assert (tmp_path / "shoal-dev.log").read_text().count("is in use") >= 1
    finally:
        server.stop()
