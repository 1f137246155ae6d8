"""The web server process (portal/webserver.py) as a client meets it."""

import http.client
import os
import socket
import subprocess
import sys
import time

import pytest

from portal.webserver import PortInUse, claim, listening_sockets
from tests.livestack import BASE_DIR, free_port


def test_a_keep_alive_connection_idle_past_a_clients_expiry_is_still_served(tmp_path):
    """httpx (the `hangar` CLI) reuses an idle connection for 5 s, and uvicorn closed one after 5 s:
    a request sent as it closed was lost. The server now keeps an idle connection longer."""
    sock = listening_sockets("127.0.0.1", 0, 1)[0]
    port = sock.getsockname()[1]
    env = {**os.environ, "HANGAR_DATA_DIR": str(tmp_path)}
    server = subprocess.Popen(
        [sys.executable, "-m", "portal.webserver", str(sock.fileno())], cwd=BASE_DIR, env=env, pass_fds=[sock.fileno()]
    )
    sock.close()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        deadline = time.monotonic() + 60
        while True:
            try:
                conn.request("GET", "/no-such-page/")
                break
            except OSError:
                assert time.monotonic() < deadline, "the web server did not start"
                conn.close()
                time.sleep(0.2)
        first = conn.getresponse()
        first.read()
        time.sleep(6)  # idle past both defaults
        conn.request("GET", "/no-such-page/")
        assert conn.getresponse().status == first.status  # answered on the same connection
    finally:
        server.terminate()
        server.wait(10)


def test_a_second_server_on_a_busy_port_is_refused_not_joined():
    port = free_port()
    first = claim("127.0.0.1", port, 2)  # a Hangar's group of two web sockets
    try:
        with pytest.raises(PortInUse, match=f"port {port} on 127.0.0.1 is in use"):
            claim("127.0.0.1", port, 2)  # SO_REUSEPORT alone would have joined the first's group
        with pytest.raises(PortInUse):
            claim("0.0.0.0", port, 1)
    finally:
        for sock in first:
            sock.close()
    again = claim("127.0.0.1", port, 1)  # free once the first is gone
    again[0].close()


def test_a_second_start_on_a_busy_port_stops_with_one_line_naming_hangar_port(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**os.environ, "HANGAR_DATA_DIR": str(tmp_path), "HANGAR_PORT": str(port)}
        done = subprocess.run(
            [sys.executable, "manage.py", "up", "--no-agent"], cwd=BASE_DIR, env=env, capture_output=True, text=True
        )

    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and said[0].startswith(f"CommandError: port {port} on 127.0.0.1 is in use"), done.stderr
    assert said[0].endswith("stop what listens there, or set HANGAR_PORT (or --port)")
    assert not (tmp_path / "hangar.sqlite3").exists() or "migrat" not in done.stdout  # said before anything else
