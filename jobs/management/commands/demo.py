"""`manage.py demo`: `manage.py up` with a living demo fleet (see jobs/demo.py)."""

import subprocess
import sys
import threading
import time

from django.conf import settings
from django.core.management.base import CommandError
from django.utils import timezone

from fleet.models import Node
from jobs import demo
from portal.management.commands import up


class Command(up.Command):
    help = (
        "Like `up`, with a simulated fleet of 8 nodes (H100 and A100), three teams with budgets, "
        "a week of cost history and a generator of a realistic job mix, until Ctrl-C."
    )

    def handle(self, *args, **options):
        # The demo's own eight agents replace the one agent for this machine.
        super().handle(*args, **{**options, "no_agent": True})

    def prepare(self) -> None:
        demo.seed()
        self.started = timezone.now()

    def more_children(self) -> dict[str, subprocess.Popen]:
        manage = str(settings.BASE_DIR / "manage.py")
        env = {**up.child_env(), "HANGAR_SIMULATE_GPUS": "1"}
        children = {}
        for node in demo.FLEET:
            argv = [sys.executable, manage, "agent", "--node", node.name, "--simulate"]
            argv += ["--sim-gpus", str(node.gpus), "--sim-model", node.model]
            children[f"agent-{node.name}"] = subprocess.Popen(argv, cwd=settings.BASE_DIR, env=env)
        return children

    def run_until_stopped(self, children: dict[str, subprocess.Popen]) -> None:
        wait_for_fleet(self.started, children)
        generator = demo.Generator()
        threading.Thread(target=generator.run, daemon=True, name="demo-generator").start()
        try:
            up.watch(children)
        finally:
            generator.stop.set()

    def fleet_line(self, no_agent: bool) -> str:
        return (
            f"  demo: {len(demo.FLEET)} simulated nodes (H100 and A100), teams vision/nlp/agents "
            "(users alice, bob, carol, agent-7; password demo-<name>), a job generator"
        )


def wait_for_fleet(since, children: dict[str, subprocess.Popen], timeout: float = 90) -> None:
    """Every demo node registered: a job submitted before would be refused (no such GPU type)."""
    deadline = time.monotonic() + timeout
    names = [node.name for node in demo.FLEET]
    while Node.objects.filter(name__in=names, last_heartbeat_at__gte=since).count() < len(names):
        up.check_alive(children)
        if time.monotonic() > deadline:
            raise CommandError(f"the demo's {len(names)} agents did not all register within {timeout:.0f}s")
        time.sleep(0.3)
