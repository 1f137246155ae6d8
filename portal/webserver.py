"""The web server: uvicorn processes, each listening on a socket of its own on one port.

uvicorn's own `--workers` share one listening socket, and the process that is waiting in
accept takes a burst of new connections whole (asyncio accepts up to the backlog at a
time): in bench/api.py 46 of 50 keep-alive clients landed on one of two workers, which
did the work of both while the other idled. Here `manage.py up` binds one SO_REUSEPORT
socket per process, so the kernel spreads new connections across the processes, and
starts each process as `python -m portal.webserver FD` on its socket.
"""

import gc
import os
import socket
import sys


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets listening on host:port in one SO_REUSEPORT group; inheritable."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = []
    for _ in range(count):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
        sockets.append(sock)
    return sockets


class PortInUse(OSError):
    """Another server listens on the port: a second Hangar must not join the first's group."""


def claim(host: str, port: int, count: int) -> list[socket.socket]:
    """`listening_sockets`, refused when anything else listens on host:port. SO_REUSEPORT lets
    any process of the same user join a group, so a second `make start` would share the port
    with the first and the kernel would split requests between two Hangars: after binding, the
    port's listeners must all be this group's (two starts at once both refuse, never share)."""
    try:
        sockets = listening_sockets(host, port, count)
    except OSError as exc:
        raise PortInUse(exc.errno, f"port {port} on {host} is in use ({exc.strerror})") from exc
    ours = {os.fstat(sock.fileno()).st_ino for sock in sockets}
    if others := listeners(port, host) - ours:
        for sock in sockets:
            sock.close()
        raise PortInUse(98, f"port {port} on {host} is in use by another server ({len(others)} listening socket(s))")
    return sockets


def listeners(port: int, host: str) -> set[int]:
    """Inodes of the sockets listening on `port` at `host` or a wildcard address (/proc/net/tcp*)."""
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, _, hex_port = fields[1].partition(":")
            if fields[3] == "0A" and int(hex_port, 16) == port and covers(address, family, host):
                found.add(int(fields[9]))
    return found


def covers(hex_address: str, family: int, host: str) -> bool:
    """Whether a listener on `hex_address` (/proc's little-endian hex) and one on `host` share
    connections: the same address, or either a wildcard."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = socket.inet_ntop(family, words)
    wildcards = ("0.0.0.0", "::")
    return host in wildcards or address in (*wildcards, host) or address == f"::ffff:{host}"


# How long an idle keep-alive connection is kept. uvicorn's default, 5 s, is also httpx's (the
# `hangar` CLI's) for reusing one: a request sent as the server closed the connection got
# "Server disconnected without sending a response", a POST whose outcome the client cannot
# know (drill 8 failed so in a fresh clone's CI). Longer than clients' expiry, and than a load
# balancer's usual 60 s, so the client or the balancer lets go first.
KEEP_ALIVE_SECONDS = 65


def serve(fd: int) -> None:
    """Serve Hangar (HTTP and websockets) on the listening socket `fd` until SIGTERM."""
    import uvicorn

    config = uvicorn.Config(
        loaded_application(),
        ws="websockets-sansio",
        access_log=False,
        log_level="warning",
        backlog=2048,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
    uvicorn.Server(config).run(sockets=[socket.socket(fileno=fd)])


def loaded_application():
    """The ASGI application with every view imported, and what that loaded frozen.

    Django, the apps and the views stay for the life of the process. gc.freeze() moves
    them out of the cyclic collector's reach, so a full collection walks only what
    requests made since: before, one stopped every thread of the process for 60-165 ms
    under load (bench/api.py's p99), after it 30-40 ms."""
    import django
    from django.urls import get_resolver

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    django.setup(set_prefix=False)
    from portal.asgi import application

    get_resolver().url_patterns  # noqa: B018  (imports every urls module and view)
    gc.freeze()
    return application


if __name__ == "__main__":
    serve(int(sys.argv[1]))
