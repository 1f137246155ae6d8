"""What a fleet of several hosts must share, and how a process tells it is part of one.

A Hangar process can tell it is on a fleet of several hosts when its database or broker
is on another host (not a loopback address, not a Unix socket, not SQLite). Then every
host must use the same secret key (job secrets are encrypted with it) and the same
MLflow tracking store (the portal shows the runs the agents' jobs log); a key generated
into one host's data directory and an SQLite file in it cannot be shared. The agent
refuses to start on such defaults (`manage.py agent`), and `manage.py check --deploy`
reports them.
"""

import ipaddress
import socket
from urllib.parse import urlsplit

from django.conf import settings
from django.core import checks


def is_loopback(host: str) -> bool:
    """A loopback address (127.0.0.0/8, ::1) or a name that resolves only to one. An empty
    host or a path (a Unix socket) is local too. A name that does not resolve is not loopback."""
    host = (host or "").strip("[]")
    if not host or host.startswith("/") or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def service_hosts() -> list[tuple[str, str, int]]:
    """(what, host, port) of the services this process talks to over a network."""
    out = []
    db = settings.DATABASES["default"]
    if "sqlite" not in db["ENGINE"]:
        out.append(("the database", db.get("HOST") or "", int(db.get("PORT") or 5432)))
    for what, url in (("the broker", settings.CELERY_BROKER_URL), ("Redis", settings.REDIS_URL)):
        parts = urlsplit(url or "")
        if parts.scheme and parts.scheme != "filesystem" and parts.hostname:
            out.append((what, parts.hostname, parts.port or 6379))
    return out


def remote_services() -> list[tuple[str, str, int]]:
    """The services on another host: non-empty means this process is part of a multi-host fleet."""
    return [s for s in service_hosts() if not is_loopback(s[1])]


def embedded_mlflow() -> bool:
    uri = settings.MLFLOW_TRACKING_URI
    return settings.HANGAR_MLFLOW and (uri.startswith(("sqlite:", "file:")) or "://" not in uri)


def shared_state_problems() -> list[tuple[str, str]]:
    """(setting, why) for each per-host default that cannot work on a fleet of several hosts;
    empty when the services are all on this host."""
    remote = remote_services()
    if not remote:
        return []
    what, host, _ = remote[0]
    where = f"{what} is on another host ({host}), so this is a fleet of several hosts"
    problems = []
    if settings.SECRET_KEY_GENERATED and not settings.HANGAR_SECRETS_KEY:
        problems.append(
            (
                "HANGAR_SECRET_KEY",
                f"{where}, but the secret key was generated into this host's data directory: jobs' secrets "
                "encrypted on the portal could not be decrypted here. Set HANGAR_SECRET_KEY (or "
                "HANGAR_SECRETS_KEY) to the same value on every host",
            )
        )
    if embedded_mlflow():
        problems.append(
            (
                "MLFLOW_TRACKING_URI",
                f"{where}, but MLflow would log to {settings.MLFLOW_TRACKING_URI}, a store on this host only: "
                "the portal would not find the runs. Set MLFLOW_TRACKING_URI to one tracking server or "
                "database for every host (or HANGAR_MLFLOW=false)",
            )
        )
    if settings.HANGAR_MLFLOW and is_loopback(urlsplit(settings.HANGAR_TRACKING_PROXY_URL).hostname or ""):
        problems.append(
            (
                "HANGAR_TRACKING_PROXY_URL",
                f"{where}, but jobs would reach MLflow's tracking proxy at {settings.HANGAR_TRACKING_PROXY_URL}, "
                "this host's loopback. Set HANGAR_TRACKING_PROXY_URL (or HANGAR_PUBLIC_URL) to the portal's address "
                "as the GPU hosts reach it",
            )
        )
    return problems


@checks.register(checks.Tags.security, deploy=True)
def check_shared_state(app_configs=None, **kwargs):
    return [
        checks.Error(why, hint=f"Set {setting} on every host of the fleet.", id=f"hangar.E10{n}")
        for n, (setting, why) in enumerate(shared_state_problems(), start=1)
    ]
