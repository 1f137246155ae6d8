"""The web server process (portal/webserver.py) as a client meets it."""

import http.client
import os
import subprocess
import sys
import time

from portal.webserver import listening_sockets
from tests.livestack import BASE_DIR


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
