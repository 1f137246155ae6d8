"""`manage.py up`: the whole product on one machine (web, scheduler, notifier, one node agent)."""

import os
import secrets
import signal
import socket
import subprocess
import sys
import time

from django.apps import apps
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from portal import metricstoken
from portal.models import Membership, Project, Role
from portal.webserver import PortInUse, claim

STOP_SECONDS = 20


class Command(BaseCommand):
    help = "Migrate, create the admin user, and run web + scheduler + a node agent until Ctrl-C."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("HANGAR_HOST") or "127.0.0.1")
        parser.add_argument("--port", type=int, default=int(os.environ.get("HANGAR_PORT") or 8000))
        parser.add_argument("--no-agent", action="store_true", help="Do not start a node agent on this machine.")
        parser.add_argument(
            "--no-scheduler", action="store_true", help="Do not start the scheduler (run `manage.py scheduler` apart)."
        )

    def handle(self, *args, host, port, no_agent, no_scheduler=False, **options):
        try:  # first: a busy port is said before anything else is done
            sockets = claim(host, port, settings.HANGAR_WEB_WORKERS)
        except PortInUse as exc:
            raise CommandError(f"{exc.strerror}: stop what listens there, or set HANGAR_PORT (or --port)") from None
        call_command("migrate", interactive=False, verbosity=0)
        call_command("example_rates")  # a first start has no rate: cost pages would read 0.00
        call_command("venv_environment")  # the local agent runs jobs in this virtualenv on request
        reset_process_metrics()
        login = ensure_admin() + scrape_token_shown()
        ensure_default_project()
        self.prepare()
        started = timezone.now()
        children = start_children(sockets, no_agent, no_scheduler)
        try:
            children.update(self.more_children())
            wait_for_port(host, port, children)
            if not no_agent:
                wait_for_agent(started, children)
            self.banner(host, port, login, no_agent)
            self.run_until_stopped(children)
        except KeyboardInterrupt:
            pass
        finally:
            stop(children)

    # Hooks for commands that start more (`manage.py demo`: its fleet and its job generator).
    def prepare(self) -> None:
        """After migrations and the admin user, before any process starts."""

    def more_children(self) -> dict[str, subprocess.Popen]:
        return {}

    def run_until_stopped(self, children: dict[str, subprocess.Popen]) -> None:
        watch(children)

    def fleet_line(self, no_agent: bool) -> str:
        return "  agent: not started (--no-agent)" if no_agent else "  a node agent for this machine is running"

    def banner(self, host, port, login: str, no_agent: bool) -> None:
        shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        lines = [
            "",
            f"  Hangar is running at http://{shown_host}:{port}/",
            f"  {login}",
            f"  data directory: {settings.DATA_DIR}",
            self.fleet_line(no_agent),
            "  Press Ctrl-C to stop.",
            "",
        ]
        self.stdout.write("\n".join(lines))
        self.stdout.flush()


def reset_process_metrics() -> None:
    """The processes' own measurements (prometheus-client multiprocess files) start again with
    the processes; the files of the previous run's processes would be summed in for ever."""
    folder = settings.PROMETHEUS_MULTIPROC_DIR
    for path in folder.glob("*.db"):
        path.unlink(missing_ok=True)


def ensure_admin() -> str:
    """Create the admin user on first start; the password is printed this once."""
    users = get_user_model().objects
    existing = users.filter(is_superuser=True).order_by("pk").first()
    if existing is not None:
        return (
            f"log in as {existing.username!r} (password shown at first start; "
            f"reset it with `python manage.py changepassword {existing.username}`)"
        )
    username = os.environ.get("HANGAR_ADMIN_USER", "admin")
    password = os.environ.get("HANGAR_ADMIN_PASSWORD") or secrets.token_urlsafe(12)
    users.create_superuser(username=username, email="", password=password)
    return f"log in as {username!r} with password {password!r} (shown once)"


def scrape_token_shown() -> str:
    """A banner line with the Prometheus scrape token, at the start that generated it (once)."""
    token, made = metricstoken.ensure()
    if not made:
        return ""
    return f"\n  Prometheus scrape token: {token} (kept in {settings.HANGAR_METRICS_TOKEN_FILE})"


def ensure_default_project() -> None:
    project, _ = Project.objects.get_or_create(slug="default", defaults={"name": "Default project"})
    for admin in get_user_model().objects.filter(is_superuser=True):
        Membership.objects.get_or_create(project=project, user=admin, defaults={"role": Role.ADMIN})


def child_env() -> dict[str, str]:
    return {**os.environ, "HANGAR_DATA_DIR": str(settings.DATA_DIR)}


def start_children(sockets: list, no_agent: bool, no_scheduler: bool = False) -> dict[str, subprocess.Popen]:
    """The web processes, one per listening socket (more use more cores: the API's throughput
    scales with them), the scheduler, the notifier and the local agent."""
    python = sys.executable
    manage = str(settings.BASE_DIR / "manage.py")
    env = child_env()
    children = {}
    for index, sock in enumerate(sockets, start=1):
        name = "web" if len(sockets) == 1 else f"web-{index}"
        argv = [python, "-m", "portal.webserver", str(sock.fileno())]
        with sock:  # the child keeps its own copy
            children[name] = subprocess.Popen(argv, cwd=settings.BASE_DIR, env=env, pass_fds=[sock.fileno()])
    commands = {"scheduler": [python, manage, "scheduler"], "notifier": [python, manage, "notifier"]}
    if no_scheduler:
        del commands["scheduler"]
    if not no_agent:
        # The local agent also runs `environment: hangar-venv` jobs (this virtualenv's python).
        known = [n for n in os.environ.get("HANGAR_NODE_ENVIRONMENTS", "").split(",") if n.strip()]
        venv = ["hangar-venv"] if sys.prefix != sys.base_prefix else []
        commands["agent"] = [python, manage, "agent", "--environments", ",".join(dict.fromkeys(known + venv))]
    for name, argv in commands.items():
        children[name] = subprocess.Popen(argv, cwd=settings.BASE_DIR, env=env)
    return children


def wait_for_port(host: str, port: int, children: dict[str, subprocess.Popen], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    target = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    while time.monotonic() < deadline:
        check_alive(children)
        if answers(target, port):
            return
        time.sleep(0.2)
    raise CommandError(f"the web server did not answer on {host}:{port} within {timeout:.0f}s")


def answers(host: str, port: int) -> bool:
    """Whether a web process answers HTTP on the port: the socket listens (its connections wait
    in the kernel's queue) from the start of `up`, before any process serves it."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as conn:
            conn.sendall(f"HEAD /login/ HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            return conn.recv(12).startswith(b"HTTP/")
    except OSError:
        return False


def wait_for_agent(since, children: dict[str, subprocess.Popen], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    nodes = apps.get_model("fleet", "Node")  # by name: the project imports no app module
    while not nodes.objects.filter(last_heartbeat_at__gte=since).exists():
        check_alive(children)
        if time.monotonic() > deadline:
            raise CommandError(f"the node agent did not register within {timeout:.0f}s")
        time.sleep(0.2)


# How a child ends when a stop was asked for: Ctrl-C reaches the whole terminal's process
# group, so a child may exit (0, or by SIGINT) before this process has seen its own SIGINT.
STOPPED = (0, -signal.SIGINT, 128 + signal.SIGINT, -signal.SIGTERM, 128 + signal.SIGTERM)


def check_alive(children: dict[str, subprocess.Popen]) -> None:
    """Raise if a child ended: KeyboardInterrupt (a clean stop, exit 0) if it was stopped, else CommandError."""
    for name, proc in children.items():
        if proc.poll() is None:
            continue
        if proc.returncode in STOPPED:
            raise KeyboardInterrupt
        raise CommandError(f"{name} exited with code {proc.returncode}; see its output above")


def watch(children: dict[str, subprocess.Popen]) -> None:
    # SIGTERM (e.g. from a service manager) stops everything like Ctrl-C does.
    signal.signal(signal.SIGTERM, raise_interrupt)
    while True:
        check_alive(children)
        time.sleep(0.5)


def raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def stop(children: dict[str, subprocess.Popen]) -> None:
    """SIGTERM everyone (the agent ends its running jobs, which are requeued), then SIGKILL
    stragglers; asked again (a second Ctrl-C or SIGTERM) it stops waiting and kills them."""
    for proc in children.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_SECONDS
    try:
        for proc in children.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for proc in children.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
