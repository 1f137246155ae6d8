"""The node agent: registers this machine and its GPUs, then keeps reporting.

The agent process is a Celery worker consuming its node's queue (see
`manage.py agent`); this module is the part beside the worker: inventory,
heartbeats and telemetry.
"""

import logging
import socket
import threading

from django.db import DatabaseError, close_old_connections, transaction
from django.utils import timezone
from django.utils.text import slugify

from fleet.gpus import GpuProvider
from fleet.models import GPU, Node

log = logging.getLogger("hangar.agent")


def default_node_name() -> str:
    return slugify(socket.gethostname()) or "local"


class Agent:
    def __init__(self, name: str, provider: GpuProvider, heartbeat_seconds: float):
        self.name = name
        self.provider = provider
        self.heartbeat_seconds = heartbeat_seconds
        self.node: Node | None = None

    def register(self) -> Node:
        """Create or update this node and its GPUs from the provider's inventory."""
        inventory = self.provider.inventory()
        model = inventory[0].model if inventory else "none"
        with transaction.atomic():
            node, _ = Node.objects.update_or_create(
                name=self.name,
                defaults={
                    "hostname": socket.gethostname(),
                    "gpu_model": model,
                    "gpu_count": len(inventory),
                    "simulated": self.provider.simulated,
                    "last_heartbeat_at": timezone.now(),
                },
            )
            node.gpus.exclude(index__in=[g.index for g in inventory]).delete()
            for gpu in inventory:
                GPU.objects.update_or_create(
                    node=node,
                    index=gpu.index,
                    defaults={"uuid": gpu.uuid, "model": gpu.model, "memory_total_mb": gpu.memory_total_mb},
                )
        self.node = node
        self.end_orphaned_attempts()
        node.heartbeat()
        return node

    def end_orphaned_attempts(self) -> None:
        """Attempts a previous agent on this node was running died with it."""
        from jobs.models import STARTED_ATTEMPT_STATES, Attempt, AttemptState, FailureClass

        for attempt in Attempt.objects.filter(node=self.node, state__in=STARTED_ATTEMPT_STATES):
            attempt.finish(AttemptState.LOST, FailureClass.INFRA, "the node's agent restarted while it ran")

    def report(self) -> None:
        from jobs.execution import RUNNING

        busy = {i for runner in list(RUNNING.values()) for i in runner.attempt.gpu_indices}
        now = timezone.now()
        gpus = {g.index: g for g in self.node.gpus.all()}
        for sample in self.provider.sample(busy):
            gpu = gpus.get(sample.index)
            if gpu is None:
                continue
            gpu.utilization_pct, gpu.memory_used_mb = sample.utilization_pct, sample.memory_used_mb
            gpu.temperature_c, gpu.power_w, gpu.sampled_at = sample.temperature_c, sample.power_w, now
        GPU.objects.bulk_update(
            gpus.values(), ["utilization_pct", "memory_used_mb", "temperature_c", "power_w", "sampled_at"]
        )
        self.node.heartbeat()

    def heartbeat_forever(self, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_seconds):
            try:
                self.report()
            except DatabaseError as exc:
                log.warning("heartbeat failed: %s", exc)
                close_old_connections()
